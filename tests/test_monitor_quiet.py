"""The quiet-step path of ``Monitor.observe`` (issue 17): the struct fill of scalars, the
families' fast fill and the quiet tail of ``_finish_step`` give what the general paths give."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest

from stability import Control, Monitor
from stability.types import Decision

CFG = {"detectors": [
    {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "grad_layers", "detector": "ewma_z", "inputs": ["grad_norm/*"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "act", "detector": "ewma_z", "inputs": ["act_std/*"],
     "params": {"warmup": 5, "alpha": 0.1}},
]}
LAYERS = ["a", "b", "c"]


def _stream(n: int = 120, seed: int = 0) -> list[tuple[dict, dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        m = {"loss": float(np.exp(rng.normal(0.7, 0.02))), "lr": 1e-3,
             "grad_norm": float(np.exp(rng.normal(0, 0.05)))}
        f = {"grad_norm": np.exp(rng.normal(0, 0.05, len(LAYERS))),
             "act_std": np.exp(rng.normal(0, 0.05, len(LAYERS)))}
        out.append((m, f))
    if n > 90:
        out[80][0]["loss"] = 60.0
        out[90][1]["grad_norm"][1] = np.inf
    return out


def _monitor() -> Monitor:
    mon = Monitor(CFG, alert_sinks=[])
    for name in ("grad_norm", "act_std"):
        mon.declare_family(name, LAYERS)
    return mon


MIXED = [np.float32(1.25), 3, True, np.int64(7), np.float64(2.5), np.uint8(4), np.float16(0.5)]


@pytest.mark.parametrize("value", MIXED, ids=lambda v: type(v).__name__)
def test_scalar_fill_converts_like_float(value) -> None:  # type: ignore[no-untyped-def]
    """Every plain real type goes through the packed fill and lands as ``float(value)``."""
    a, b = _monitor(), _monitor()
    for s, (m, f) in enumerate(_stream()):
        ma, mb = dict(m), dict(m)
        if s % 7 == 3:
            ma["grad_norm"], mb["grad_norm"] = value, float(value)
        assert a.observe(s, ma, f) == b.observe(s, mb, f)
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


def test_failed_pack_falls_back_and_skips_only_the_bad_value() -> None:
    """A huge int fails the packed fill midway: the checked path then takes every key, skips
    the bad one, and the slots equal those of a step without it."""
    a, b = _monitor(), _monitor()
    for s, (m, f) in enumerate(_stream()):
        ma, mb = dict(m), dict(m)
        if s in (30, 31):
            ma = {"loss": m["loss"], "grad_norm": 10**400, "lr": m["lr"]}
            mb = {"loss": m["loss"], "lr": m["lr"]}
        da, db = a.observe(s, ma, f), b.observe(s, mb, f)
        assert (da.alarms, da.interventions, da.control) == (db.alarms, db.interventions,
                                                            db.control)
        assert len(da.skipped) == (1 if s in (30, 31) else 0) and db.skipped == ()
    assert a.counters == {**b.counters, "skipped_values": 2}
    assert np.array_equal(a._vals, b._vals, equal_nan=True)
    sa, sb = a.state_dict(), b.state_dict()
    sa["counters"]["skipped_values"] = 0
    assert json.dumps(sa) == json.dumps(sb)


def test_family_fill_fast_and_converted_paths_agree() -> None:
    """float64 arrays (memoryview copy), float32 arrays and lists (converted) agree."""
    mons = [_monitor() for _ in range(3)]
    for s, (m, f) in enumerate(_stream()):
        variants = [f, {k: v.astype(np.float32).astype(np.float64) for k, v in f.items()},
                    {k: v.astype(np.float32).tolist() for k, v in f.items()}]
        if s % 2:  # only the float32 rounding differs: feed the same values to all three
            variants[0] = variants[1]
        ds = [mon.observe(s, m, v) for mon, v in zip(mons, variants, strict=True)]
        assert ds[1] == ds[2]
        if s % 2:
            assert ds[0] == ds[1]
    assert json.dumps(mons[1].state_dict()) == json.dumps(mons[2].state_dict())


def test_quiet_decisions_are_proper_frozen_decisions() -> None:
    mon = _monitor()
    quiet = [mon.observe(s, m, f) for s, (m, f) in enumerate(_stream(40))]
    d = quiet[-1]
    assert d == Decision(39, (), (), Control(), ()) and d.healthy
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.step = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(d)) == d
    assert dataclasses.replace(d, step=5).step == 5 and d.step == 39
    assert [x.step for x in quiet] == list(range(40))
    assert mon.goodput.steps == 40 and mon.counters["steps"] == 40


def test_quiet_tail_matches_the_general_tail(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The quiet branch of ``_finish_step`` equals the general path it shortcuts: a monitor
    whose policy is always 'dirty' (the general path on every step, the policy stepping with
    no alarm) decides the same, and ends with the same ledger and gradient history."""
    fast, slow = _monitor(), _monitor()
    n = 0
    orig = slow._policy_step

    def general(s, alarms, gnow):  # type: ignore[no-untyped-def]
        nonlocal n
        n += 1
        return orig(s, alarms, gnow)

    monkeypatch.setattr(slow, "_policy_step", general)
    for s, (m, f) in enumerate(_stream()):
        slow._policy_dirty = slow._policy_dirty or not slow.policy.guard.active
        da, db = fast.observe(s, m, f), slow.observe(s, m, f)
        assert da == db
    assert n > 100  # the general path really ran on (nearly) every step
    assert fast.goodput.summary() == slow.goodput.summary()
    assert list(fast._grad_hist) == list(slow._grad_hist)
    assert fast.counters == slow.counters
