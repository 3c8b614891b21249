"""``stability/*`` feedback metrics and the intervention log line (framework-free + guard)."""

from __future__ import annotations

import logging
import math

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.feedback import (
    ACTING,
    InterventionTally,
    describe,
    feedback_metrics,
    is_acting,
    log_interventions,
)
from stability.types import (
    INTERVENTION_TYPES,
    Alert,
    Checkpoint,
    Control,
    Decision,
    ReduceLR,
    Rollback,
    SetClip,
    SkipStep,
    Stop,
)


def _spiky_monitor() -> Monitor:
    return Monitor({"detectors": [
        {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
        {"name": "spike", "detector": "ewma_z", "inputs": ["loss"],
         "params": {"warmup": 5, "alpha": 0.1}}],
        "policy": {"cooldown": 2}})


def test_quiet_step_metrics() -> None:
    mon = _spiky_monitor()
    d = None
    for s in range(10):
        d = mon.observe(s, {"loss": 2.0 + 0.01 * (s % 3)})
    m = feedback_metrics(mon, d)
    assert m["stability/lr_factor"] == 1.0 and "stability/clip_norm" not in m
    assert m["stability/level"] == 0.0 and m["stability/alarms"] == 0.0
    assert m["stability/alarms_total"] == 0.0
    assert set(k for k in m if k.startswith("stability/score/")) == {
        "stability/score/nan", "stability/score/spike"}
    assert math.isfinite(m["stability/score/spike"]) and m["stability/score/spike"] < 6.0
    assert all(isinstance(v, float) for v in m.values())


def test_alarm_step_metrics_follow_the_decision() -> None:
    mon = _spiky_monitor()
    for s in range(20):
        mon.observe(s, {"loss": 2.0 + 0.01 * (s % 3)})
    d = mon.observe(20, {"loss": 40.0})
    assert d.alarms
    m = feedback_metrics(mon, d, extra={"steps_skipped": 3, "stability/rollbacks": 1,
                                        "note": "text is left out"})
    assert m["stability/alarms"] == float(len(d.alarms))
    assert m["stability/alarms_total"] == float(mon.counters["alarms"])
    assert m["stability/score/spike"] == pytest.approx(max(a.score for a in d.alarms))
    assert m["stability/score/spike"] > 6.0
    assert m["stability/level"] >= 1.0
    assert m["stability/lr_factor"] == d.control.lr_factor
    clip = d.control.clip_norm
    assert ("stability/clip_norm" not in m if clip is None
            else m["stability/clip_norm"] == clip)
    assert m["stability/steps_skipped"] == 3.0 and m["stability/rollbacks"] == 1.0
    assert "stability/note" not in m


def test_without_monitor_or_decision() -> None:
    m = feedback_metrics(None, None, {"x": 1})
    assert m["stability/lr_factor"] == 1.0 and m["stability/x"] == 1.0
    mon = _spiky_monitor()
    mon.control.lr_factor = 0.25
    assert feedback_metrics(mon)["stability/lr_factor"] == 0.25


def test_tally_counts_and_round_trip() -> None:
    t = InterventionTally()
    t.add(Decision(1, interventions=(Alert(1), SetClip(1, max_norm=2.0))))
    t.add(Decision(2, interventions=(Alert(2), ReduceLR(2), SkipStep(2))))
    t.add([Rollback(3, to_step=0).to_dict()])
    m = t.metrics()
    assert m["interventions/alert"] == 2.0 and m["interventions/set_clip"] == 1.0
    assert m["interventions/rollback"] == 1.0 and m["interventions/stop"] == 0.0
    assert m["interventions/acting"] == 4.0 == t.acting
    assert set(f"interventions/{k}" for k in INTERVENTION_TYPES) <= set(m)
    t2 = InterventionTally()
    t2.load_state_dict(t.state_dict())
    assert t2.metrics() == m


@pytest.mark.parametrize("iv", [ReduceLR(4, "r", factor=0.5, duration=10),
                                SetClip(4, "r", max_norm=1.5, duration=0), SkipStep(4, "r"),
                                Checkpoint(4, "r"), Rollback(4, "r", 1, 2, 4), Stop(4, "r"),
                                Alert(4, "r", severity="critical")])
def test_describe_every_type(iv) -> None:
    line = describe(iv)
    assert line.startswith("step 4: ") and line.endswith("(r)")
    assert is_acting(iv) == (iv.type in ACTING) == (iv.type != "alert")


def test_log_line_per_acting_intervention(caplog: pytest.LogCaptureFixture) -> None:
    d = Decision(7, interventions=(Alert(7, "x"), ReduceLR(7, "L2: loss_spike(loss)", factor=0.5),
                                   SkipStep(7, "x")))
    with caplog.at_level(logging.INFO, logger="stability.adapters"):
        n = log_interventions(d)
    assert n == 2
    msgs = [r.getMessage() for r in caplog.records if r.name == "stability.adapters"]
    assert msgs == ["stability: step 7: reducing the LR factor to 0.5 for 100 steps "
                    "(L2: loss_spike(loss))", "stability: step 7: skipping the optimizer step (x)"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


# ---------------------------------------------------------------------------- with the guard
torch = pytest.importorskip("torch")


class _Scripted:
    def __init__(self, script: dict[int, Decision]) -> None:
        self.script = script
        self.control = Control()

    def observe(self, step: int, metrics=None, families=None) -> Decision:
        d = self.script.get(step, Decision(step, control=Control(
            lr_factor=self.control.lr_factor)))
        self.control = d.control
        return d


def test_guard_metrics_and_log_line(caplog: pytest.LogCaptureFixture) -> None:
    from stability.adapters.torch import TorchGuard

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    cut = Decision(2, interventions=(Alert(2, "why"), ReduceLR(2, "why", factor=0.25)),
                   control=Control(lr_factor=0.25))
    guard = TorchGuard(m, opt, sched, _Scripted({2: cut}), checkpoint_every=0)
    x = torch.randn(16, 3)
    with caplog.at_level(logging.INFO, logger="stability.adapters"):
        for _ in range(5):
            loss = m(x).pow(2).mean()
            loss.backward()
            guard.step(loss)
            fm = guard.metrics()
            # what the user sees in param_groups is what was applied / will be applied
            assert fm["stability/lr_effective"] == pytest.approx(opt.param_groups[0]["lr"])
    assert fm["stability/lr_factor"] == 0.25
    assert fm["stability/lr_base"] == pytest.approx(sched.get_last_lr()[0])
    assert fm["stability/lr_effective"] == pytest.approx(0.25 * 0.2 / 6)
    assert fm["stability/interventions/reduce_lr"] == 1.0
    assert fm["stability/interventions/acting"] == 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "stability.adapters"]
    assert lines == ["stability: sync='auto' resolved to 'step' (parameters on cpu)",  # once
                     "stability: step 2: reducing the LR factor to 0.25 for 100 steps (why)"]
