"""Monitor.calibrate: priming every detector from earlier history without alarming or acting."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stability.monitor.calibrate import calibrate
from stability.monitor.monitor import Monitor
from stability.types import ReduceLR
from tests.shared_data import SHARED

BLOOM = (SHARED / "realruns" / "bigscience_chronicles"
         / "tr11-176B_BLOOM_first_loss_spike_31216.parquet")


def _history(n: int = 300, seed: int = 0, start: int = 0, level: float = 2.2,
             gn: float = 0.25, lr: float = 1e-4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"step": np.arange(start, start + n),
            "loss": level * np.exp(0.02 * rng.standard_normal(n)),
            "grad_norm": gn * np.exp(0.1 * rng.standard_normal(n)),
            "lr": np.full(n, lr)}


def _window(start: int, gn: float = 0.25, lr: float = 1e-4) -> dict[str, np.ndarray]:
    """A short window like the BigScience quotes: two quiet rows, then a grad-norm blow-up."""
    g = gn * np.array([1.0, 1.05, 4.0, 60.0, 600.0, 4000.0])
    loss = np.array([2.2, 2.21, 2.6, 2.3, 2.4, 5.1])
    return {"step": np.arange(start, start + 6), "loss": loss, "grad_norm": g,
            "lr": np.full(6, lr)}


def _alarm_steps(decisions) -> list[int]:
    return [d.step for d in decisions if d.alarms]


def test_calibrated_monitor_alarms_on_a_short_window_a_fresh_one_sees_late() -> None:
    fresh = Monitor("default", alert_sinks=[])
    # the preset's priors alone: only the 2.3x loss of the last row (the grad norm's own
    # variance is still mostly its first rows')
    assert _alarm_steps(fresh.replay(_window(1000))) == [1005]
    mon = Monitor("default", alert_sinks=[])
    assert mon.calibrate(_history()) == 300
    steps = _alarm_steps(mon.replay(_window(1000)))
    assert steps and steps[0] <= 1003
    kinds = {a.kind for d in mon.replay(_window(2000)) for a in d.alarms}
    assert "grad_explosion" in kinds


def test_calibration_emits_nothing_and_leaves_runtime_state_alone() -> None:
    seen: list[object] = []
    mon = Monitor("default", alert_sinks=[], on_alarm=seen.append,
                  on_intervention=seen.append)
    before = mon.state_dict()
    hist = _history()
    hist["loss"][150] = 1e3          # a fault inside the history: no alarm, no intervention
    hist["grad_norm"][151] = np.nan
    mon.calibrate(hist, resume=False)   # a previous run of the recipe: the policy stays fresh
    after = mon.state_dict()
    assert seen == []
    for key in ("policy", "control", "policy_control", "last_step", "counters", "lr_now"):
        assert after[key] == before[key], key
    finite = hist["grad_norm"][np.isfinite(hist["grad_norm"])]
    assert after["grad_history"] == pytest.approx(finite[-len(after["grad_history"]):].tolist())
    assert mon.control.lr_factor == 1.0 and not mon.control.skip_step
    # a new run of the same recipe may start again at step 0
    d = mon.observe(0, {"loss": 2.2, "grad_norm": 0.25, "lr": 1e-4})
    assert d.step == 0 and not d.alarms


def test_detector_state_equals_a_replay_of_the_same_rows() -> None:
    hist = _history(seed=3)
    hist["val_loss"] = np.where(np.arange(300) % 25 == 0, 2.3, np.nan)
    hist["val_loss"] = np.ma.masked_invalid(hist["val_loss"])
    a = Monitor("default", alert_sinks=[])
    a.calibrate(hist)
    b = Monitor("default", alert_sinks=[])
    b.replay(hist)
    sa, sb = a.state_dict(), b.state_dict()
    assert json.dumps(sa["bindings"], sort_keys=True) == json.dumps(sb["bindings"],
                                                                  sort_keys=True)
    assert sa["slots"] == sb["slots"]
    assert sa["grad_history"] == sb["grad_history"]
    # and both decide the same from here on
    w = _window(5000)
    assert [d.to_dict() for d in a.replay(w)] == [d.to_dict() for d in b.replay(w)]


def test_batches_are_fed_in_order_and_equal_one_table() -> None:
    hist = _history(seed=5)
    a = Monitor("default", alert_sinks=[])
    a.calibrate(hist)
    b = Monitor("default", alert_sinks=[])
    parts = [{k: v[:120] for k, v in hist.items()}, {k: v[120:] for k, v in hist.items()}]
    assert b.calibrate(iter(parts)) == 300
    assert a.state_dict()["bindings"] == b.state_dict()["bindings"]


def test_a_stale_calibration_alarm_does_not_leak_into_the_next_step() -> None:
    hist = _history(seed=7)
    hist["grad_norm"][-1] = 1e6      # the last calibration row is in alarm
    mon = Monitor("default", alert_sinks=[])
    mon.calibrate(hist)
    assert not mon.observe(0, {"loss": 2.2}).alarms


def test_bad_input_is_rejected() -> None:
    mon = Monitor("default", alert_sinks=[])
    with pytest.raises(TypeError, match=r"^The 'data' parameter of calibrate must be a table "
                       r".* Got 'runs/public_0001\.parquet' instead\.  Read a recorded run"):
        mon.calibrate("runs/public_0001.parquet")
    with pytest.raises(TypeError, match=r"'data' parameter of calibrate .* Got 3 instead"):
        calibrate(mon, 3)
    with pytest.raises(ValueError, match="step"):
        mon.calibrate({"loss": np.ones(3)})
    assert mon.calibrate([]) == 0


@pytest.mark.skipif(not BLOOM.exists(), reason="shared BigScience windows absent")
def test_bloom_first_spike_alarms_after_calibration() -> None:
    """BLOOM-176B 31214-31251: 11 quoted rows, too short for any warm-up.

    The chronicle has no earlier rows, so the earlier history is synthetic: 300 steps at the
    window's own pre-spike level (loss 2.2, grad norm 0.24, the same LR) with the noise of a
    healthy run.
    """
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(BLOOM)
    fresh = Monitor("llm_pretrain", alert_sinks=[])
    # the preset's priors alone: the 2.3x loss at 31219, three rows into the event
    assert _alarm_steps(fresh.replay(table)) == [31219]
    mon = Monitor("llm_pretrain", alert_sinks=[])
    mon.calibrate(_history(n=300, start=30914, level=2.2, gn=0.24, lr=5.279e-05))
    decisions = mon.replay(table)
    steps = _alarm_steps(decisions)
    assert steps and steps[0] <= 31217          # the grad norm is 65x its level at 31217
    assert any(a.kind == "grad_explosion" for d in decisions for a in d.alarms)


def test_cli_save_state_continues_live(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from replay.cli import main

    hist = _history(seed=11)
    path = tmp_path / "run.parquet"
    pq.write_table(pa.table(hist), path)
    out = tmp_path / "state.json"
    assert main(["replay", str(path), "--save-state", str(out)]) == 0
    live = Monitor("default", alert_sinks=[])
    live.load_state_dict(json.loads(out.read_text()))
    ref = Monitor("default", alert_sinks=[])
    ref.replay(hist)
    w = _window(300)
    got = [d.to_dict() for d in live.replay(w)]
    assert got == [d.to_dict() for d in ref.replay(w)]
    assert any(d["alarms"] for d in got)


def test_cli_save_state_takes_one_run(tmp_path, capsys) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from replay.cli import main

    for name in ("a", "b"):
        pq.write_table(pa.table(_history(n=50)), tmp_path / f"{name}.parquet")
    out = tmp_path / "state.json"
    assert main(["replay", str(tmp_path), "--save-state", str(out)]) == 2
    assert "--save-state takes one run" in capsys.readouterr().err
    assert not out.exists()


def _lr_history(n: int = 300, warm: int = 50, peak: float = 3e-4, seed: int = 0
                ) -> dict[str, np.ndarray]:
    """Warm-up then cosine decay, healthy loss and grad norm."""
    h = _history(n=n, seed=seed)
    s = np.arange(n, dtype=float)
    h["lr"] = peak * np.minimum(1.0, (s + 1) / warm) * 0.5 * (1 + np.cos(np.pi * s / (2 * n)))
    return h


def test_resume_primes_lr_guard_and_loss_tracker_like_a_replay() -> None:
    hist = _lr_history()
    hist["loss"][200] = np.nan         # a non-finite loss in the history is not counted
    a = Monitor("default", alert_sinks=[])
    a.calibrate(hist)
    b = Monitor("default", alert_sinks=[])
    b.replay({k: (v if k != "loss" else np.where(np.isnan(v), v[199], v))
              for k, v in hist.items()})
    pa, pb = a.state_dict(), b.state_dict()
    assert pa["policy"]["guard"] == pb["policy"]["guard"]
    assert pa["policy"]["guard"]["warm"] and pa["policy"]["guard"]["primed"]
    assert pa["policy"]["loss"]["nf_run"] == 0
    assert (pa["lr_now"], pa["lr_prev"]) == (pb["lr_now"], pb["lr_prev"])
    assert a.policy.loss.base == pytest.approx(b.policy.loss.base, rel=1e-3)
    assert a.policy.loss.worse(0.1) is False
    assert Monitor("default", alert_sinks=[]).policy.loss.worse(0.1) is None


def test_restart_with_the_wrong_lr_is_an_lr_fault_on_its_first_step() -> None:
    hist = _lr_history()
    nxt = {"loss": 2.2, "grad_norm": 0.25, "lr": 10 * float(hist["lr"][-1])}  # x10 on restart

    def lr_cuts(mon: Monitor) -> list:
        """The LR guard's persistent divide-out (``duration = 0``; the lr_jump detector's
        temporary cut is a different response)."""
        d = mon.observe(300, nxt)
        return [iv for iv in d.interventions
                if iv.cause == "lr" and isinstance(iv, ReduceLR) and iv.duration == 0]

    fresh = Monitor("default", alert_sinks=[])
    fresh.calibrate(hist, resume=False)
    assert lr_cuts(fresh) == []                      # the guard has no trajectory: blind
    mon = Monitor("default", alert_sinks=[])
    mon.calibrate(hist)
    cuts = lr_cuts(mon)
    assert cuts and cuts[0].factor == pytest.approx(0.1, rel=1e-6)
    assert mon.control.lr_factor == pytest.approx(0.1, rel=1e-6)
    # the right LR on restart is not a fault
    ok = Monitor("default", alert_sinks=[])
    ok.calibrate(hist)
    d = ok.observe(300, dict(nxt, lr=float(hist["lr"][-1]) * 0.999))
    assert not d.interventions and ok.control.lr_factor == 1.0


def test_resume_respects_a_disabled_lr_guard() -> None:
    cfg = {"preset": "default", "policy": {"lr_guard": {"enabled": False}}}
    mon = Monitor(cfg, alert_sinks=[])
    mon.calibrate(_lr_history())
    assert mon.policy.guard.n == 0
    assert np.isfinite(mon.policy.loss.base)
