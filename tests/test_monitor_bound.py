"""Bound inputs (``Monitor.bind_inputs`` / ``observe_bound``, issue 17): the same decisions,
scores, state and goodput as ``observe()`` fed the same dicts, bit for bit, step by step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stability import Monitor
from stability.monitor.bound import BoundInputs

LAYERS = [f"L{i}" for i in range(6)]
FAMS = ("act_mean", "act_std", "act_absmax", "act_kurtosis", "grad_norm")
KEYS = ["loss", "lr", "grad_norm", "param_norm", "loss_scale", "val_loss", "update_ratio"]
N = 430
ROUND_TRIP = 350


def _stream(seed: int = 1) -> list[tuple[int, dict, dict, dict]]:
    """``(step, metrics, families, extra)``: the metrics and families observe() gets (missing
    keys left out; a partly logged family as separate keys in ``metrics``) and the extra
    metrics given to observe_bound beside the bound ones."""
    rng = np.random.default_rng(seed)
    out = []
    step = 0
    for t in range(N):
        step += 1 if t != 140 else 0  # step 140 repeats step 139: skipped, like observe()
        if t == 141:
            step = 141
        m: dict = {"loss": float(np.exp(rng.normal(0.7, 0.02))), "lr": 3e-4,
                   "grad_norm": float(np.exp(rng.normal(0, 0.05))), "param_norm": 50.0 + t * 0.01,
                   "loss_scale": 65536.0, "update_ratio": float(np.exp(rng.normal(-7, 0.1)))}
        if t % 20 == 0:
            m["val_loss"] = m["loss"] + 0.05
        f = {k: np.exp(rng.normal(0, 0.05, len(LAYERS))) for k in FAMS}
        f["act_mean"] -= 1.0
        extra: dict = {}
        if t == 160:
            m["loss"] = 80.0                       # a loss spike
        if t == 200:
            m["loss"] = math.nan                   # NaN: the non-finite guard
        if t == 230:
            f["grad_norm"][2] = math.inf
        if t == 240:
            f["act_std"][0] = -math.inf
        if 250 <= t < 256:
            del m["grad_norm"]                     # not logged
        if 260 <= t < 270:
            del f["act_kurtosis"]                  # a family not logged
        if t == 280:                               # two layers of a family not logged
            g = f.pop("grad_norm")
            m.update({f"grad_norm/{x}": float(v) for j, (x, v) in enumerate(
                zip(LAYERS, g, strict=True)) if j not in (1, 4)})
        if 300 <= t < 330:
            m["lr"] = 3e-4 * 50                    # an LR fault
        if t == 120:                               # 40 new names: the slot vector grows
            extra = {f"aux{i}": float(i) for i in range(40)}
        if t in (121, 300):
            extra["amp_overflow"] = 1.0
        out.append((step if t != 90 else -1, m, f, extra))  # step -1: a bad step
    return out


class _Plain(Monitor):
    """A monitor on the plain path (no fused driver)."""

    def _relayout(self) -> None:
        super()._relayout()
        self._fused = None
        self._fused_args = ()


def _new(preset: str, plain: bool, copy_mode: bool) -> tuple[Monitor, BoundInputs]:
    mon = (_Plain if plain else Monitor)(preset, alert_sinks=[])
    if copy_mode:  # names bound in another order first: not one block in binding order
        mon.bind_inputs(KEYS[::-1])
    return mon, mon.bind_inputs(KEYS, families={k: LAYERS for k in FAMS})


def _write(inp: BoundInputs, m: dict, f: dict, rng: np.random.Generator) -> None:
    """Write one step into the views; entries not logged get garbage (it must not matter)."""
    for k in inp.keys:
        v = m.get(k)
        inp.values[inp.index(k)] = rng.normal() * 1e300 if v is None else v
        inp.present[inp.index(k)] = v is not None
    for name in inp.families:
        a, p = inp.arrays[name], inp.family_present[name]
        if name in f:
            a[:] = f[name]
            p[:] = True
        else:
            a[:] = [m.get(f"{name}/{x}", np.nan) for x in LAYERS]
            p[:] = [f"{name}/{x}" in m for x in LAYERS]


def _same(a: Monitor, b: Monitor) -> None:
    assert a._gather.scores.tobytes() == b._gather.scores.tobytes()
    assert a._gather.alarms.tobytes() == b._gather.alarms.tobytes()


@pytest.mark.parametrize(("preset", "plain", "copy_mode", "trip"), [
    ("llm_pretrain", False, False, "fresh"), ("llm_pretrain", False, False, "self"),
    ("default", False, True, "fresh"), ("default", True, False, "self"),
    ("small", False, False, "fresh")])
def test_bound_equals_observe(preset: str, plain: bool, copy_mode: bool, trip: str) -> None:
    """Spikes, NaN, inf, missing keys / families / layers, validation points, an LR fault,
    a repeated and a bad step, a growing slot vector, extra metrics and a state_dict round trip
    in the middle: every decision, every score, the final state and goodput are identical."""
    bound, inp = _new(preset, plain, copy_mode)
    ref, _ = _new(preset, plain, copy_mode)  # the same layout, fed through observe()
    assert inp.zero_copy is not copy_mode
    rng = np.random.default_rng(7)
    kinds = set()
    for t, (step, m, f, extra) in enumerate(_stream()):
        if t == ROUND_TRIP:
            sb, sr = bound.state_dict(), ref.state_dict()
            assert json.dumps(sb) == json.dumps(sr)
            if trip == "fresh":  # a new monitor from the state, bound again
                bound = (_Plain if plain else Monitor)(preset, alert_sinks=[])
                ref = (_Plain if plain else Monitor)(preset, alert_sinks=[])
                bound.load_state_dict(sb)
                ref.load_state_dict(sr)
                inp = bound.bind_inputs(KEYS, families={k: LAYERS for k in FAMS})
            else:  # the same monitor reloaded: the old views go on working (copied)
                bound.load_state_dict(sb)
                ref.load_state_dict(sr)
                assert not inp.zero_copy
        _write(inp, m, f, rng)
        db = bound.observe_bound(step, extra or None)
        dr = ref.observe(step, {**m, **extra}, {k: v for k, v in f.items() if k in FAMS})
        assert repr(db) == repr(dr), t
        _same(bound, ref)
        kinds |= {a.kind for a in db.alarms}
        kinds |= {type(iv).__name__ for iv in db.interventions}
    assert json.dumps(bound.state_dict()) == json.dumps(ref.state_dict())
    assert bound.goodput.summary() == ref.goodput.summary()
    assert bound.counters == ref.counters
    assert bound.counters["skipped_steps"] == 2
    assert {"nonfinite", "loss_spike"} <= kinds  # the faults were seen
    assert bound.counters["alarms"] > 3


def test_views_are_the_slot_vector() -> None:
    mon = Monitor("llm_pretrain", alert_sinks=[])
    inp = mon.bind_inputs(["loss", "lr"], families={"grad_norm": LAYERS, "act_std": LAYERS})
    assert inp.zero_copy and inp.family_matrix is not None
    assert inp.family_matrix.shape == (2, len(LAYERS))
    for v in (inp.values, inp.present, inp.arrays["grad_norm"], inp.family_matrix):
        assert v.flags.writeable
    assert np.shares_memory(inp.values, mon._vals)
    inp.family_matrix[1] = 7.0
    assert (inp.arrays["act_std"] == 7.0).all()
    inp["loss"] = 2.5
    assert inp["loss"] == 2.5 and inp.present[inp.index("loss")]
    inp["lr"] = None
    assert not inp.present[inp.index("lr")]
    d = mon.observe_bound(0)
    assert d.step == 0 and d.healthy and not mon._present.any()  # the step cleared presence
    assert mon.signals[:2] == ["loss", "lr"]


def test_bind_inputs_misuse() -> None:
    mon = Monitor("llm_pretrain", alert_sinks=[])
    with pytest.raises(ValueError, match="no inputs bound"):
        mon.observe_bound(0)
    cfg = {"detectors": [{"name": "spike", "detector": "ewma_z", "inputs": ["loss"]}]}
    only_loss = Monitor(cfg, alert_sinks=[])
    with pytest.raises(ValueError, match="matches no detector binding"):
        only_loss.bind_inputs(["loss", "tokens_per_s"])
    with pytest.raises(KeyError, match="not declared"):
        mon.bind_inputs(["loss"], families=["act_std"])
    with pytest.raises(TypeError):
        mon.bind_inputs("loss")
    with pytest.raises(ValueError, match="unique"):
        mon.bind_inputs(["loss", "loss"])
    with pytest.raises(ValueError, match="same signal"):
        mon.bind_inputs(["grad_norm/L0"], families={"grad_norm": LAYERS})
    other = Monitor("llm_pretrain", alert_sinks=[]).bind_inputs(["loss"])
    with pytest.raises(ValueError, match="no inputs bound"):
        mon.observe_bound(0, inputs=other)
    capped = Monitor({**cfg, "monitor": {"max_series": 1}}, alert_sinks=[])
    capped.bind_inputs(["loss"])
    with pytest.raises(ValueError, match="matches no detector binding|max_series"):
        capped.bind_inputs(["val_loss"])
    assert only_loss.observe(0, {"loss": 1.0}).healthy  # nothing half-bound breaks observe


def test_aliases_bind_their_signal() -> None:
    mon = Monitor({"monitor": {"aliases": {"train/loss": "loss"}}, "detectors": [
        {"name": "nan", "detector": "nonfinite", "inputs": ["*"]}]}, alert_sinks=[])
    inp = mon.bind_inputs(["train/loss"])
    inp["train/loss"] = math.inf
    d = mon.observe_bound(0)
    assert [(a.kind, a.signal) for a in d.alarms] == [("nonfinite", "loss")]
    with pytest.raises(ValueError, match="same signal"):
        mon.bind_inputs(["train/loss", "loss"])


def test_declared_families_and_nothing_logged() -> None:
    """Families declared beforehand bind by name (their block comes first: still one block);
    a step with nothing present is a step of ``observe(step, {})``."""
    mons = [Monitor("default", alert_sinks=[]) for _ in range(2)]
    for mon in mons:
        mon.declare_family("grad_norm", LAYERS)
    inp = mons[0].bind_inputs(["loss", "lr"], families=["grad_norm"])
    assert inp.zero_copy
    assert mons[0].signals[: len(LAYERS)] == [f"grad_norm/{x}" for x in LAYERS]
    rng = np.random.default_rng(3)
    for s in range(150):
        m = {"loss": 2.0 + 0.01 * rng.standard_normal(), "lr": 1e-3}
        g = np.exp(0.05 * rng.standard_normal(len(LAYERS)))
        if s % 10 == 9:  # nothing logged on this step
            inp.present[:] = False
            inp.family_present["grad_norm"][:] = False
            m, fams = {}, {}
        else:
            inp.present[:] = True
            inp.family_present["grad_norm"][:] = True
            inp.values[:] = m["loss"], m["lr"]
            inp.arrays["grad_norm"][:] = g
            fams = {"grad_norm": g}
        assert repr(mons[0].observe_bound(s)) == repr(mons[1].observe(s, m, fams))
    assert json.dumps(mons[0].state_dict()) == json.dumps(mons[1].state_dict())
    assert "zero_copy=True" in repr(inp)
