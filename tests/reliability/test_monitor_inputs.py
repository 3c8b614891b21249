"""The monitor fed hostile metric streams (non-strict mode).

Core property (hypothesis over random interleavings of bad inputs): a monitor A fed a finite
prefix, then a *bad section*, then a finite suffix raises exactly the same detector alarms on the
suffix as a monitor B fed only the prefix and the suffix (same step numbers).  The bad section holds
only things that must never reach detector statistics: NaN / inf values, ``None``, strings,
arrays, complex numbers, objects, non-string keys, non-mapping metrics, bad family arrays,
rejected steps (negative, repeated, backwards, non-integer) carrying finite values, huge step
gaps.  Both monitors run ``log_only`` so the policy cannot move the step counter (a rollback
legitimately re-opens earlier steps); alarms are compared, not interventions.

Also: no exception escapes ``observe()``; detector state stays finite; per-layer families change
size; metrics appear and disappear.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stability.monitor.monitor import Monitor

LAYERS = [f"blk{i}" for i in range(4)]
FAMILIES = ["grad_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_kurtosis"]
N_PREFIX, N_SUFFIX = 130, 90


def make_monitor(log_only: bool = True) -> Monitor:
    mon = Monitor({"preset": "llm_pretrain", "monitor": {"log_only": log_only}})
    for f in FAMILIES:
        mon.declare_family(f, LAYERS)
    return mon


def finite_step(rng: np.random.Generator, s: int, spike: bool = False) -> tuple[dict[str, Any],
                                                                                 dict[str, Any]]:
    loss = 3.0 * math.exp(-s / 400) + 0.02 * rng.standard_normal()
    if spike:
        loss *= 20.0
    m: dict[str, Any] = {"loss": loss, "lr": 1e-3 * min(1.0, (s + 1) / 50),
                         "grad_norm": abs(1.0 + 0.1 * rng.standard_normal()) * (50 if spike else 1),
                         "tokens_per_sec": 1e5}
    if s % 25 == 0:
        m["val_loss"] = loss + 0.1
    fam = {
        "grad_norm": np.abs(0.3 + 0.03 * rng.standard_normal(4)),
        "update_ratio": np.abs(1e-3 + 1e-4 * rng.standard_normal(4)),
        "act_mean": 0.01 * rng.standard_normal(4),
        "act_std": np.abs(1.0 + 0.05 * rng.standard_normal(4)),
        "act_absmax": np.abs(5.0 + 0.3 * rng.standard_normal(4)),
        "act_kurtosis": np.abs(3.0 + 0.2 * rng.standard_normal(4)),
    }
    return m, fam


class _Opaque:
    pass


class _RaisingFloat:
    def __float__(self) -> float:
        raise RuntimeError("__float__ fails")


BAD_VALUES = [math.nan, math.inf, -math.inf, None, "1.5", b"2", np.zeros(3), np.array(["x"]),
              _Opaque(), 1 + 2j, [1.0], {"a": 1.0}, np.float32("nan"), np.array([math.inf]),
              np.complex128(1 + 2j), np.complex64(3.0), np.array(2 + 0j), _RaisingFloat()]
BAD_STEPS = [-1, -10**9, "REPEAT", "BACK", 1.5, True, None, "7", math.nan, math.inf, np.int64(-3),
             2**53, 2**63, 10**20, 1e20, np.uint64(2**64 - 1), np.float64(1e300)]
NAMES = ["loss", "grad_norm", "lr", "val_loss", "grad_norm/blk1", "grad_norm/blk_new",
         "brand_new_metric", "act_std/blk0"]

bad_action = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(NAMES), st.sampled_from(range(len(BAD_VALUES)))),
    st.tuples(st.just("step"), st.sampled_from(range(len(BAD_STEPS))), st.just(0)),
    st.tuples(st.just("family"), st.sampled_from(FAMILIES + ["undeclared"]),
              st.sampled_from(range(7))),
    st.tuples(st.just("metrics"), st.sampled_from(range(5)), st.just(0)),
    st.tuples(st.just("gap"), st.sampled_from([1, 10**6]), st.just(0)),
)


def bad_family(kind: int) -> Any:
    return [np.full(4, math.nan), np.array([math.inf, 1.0, 1.0, -math.inf]), np.zeros(3),
            np.array(["a", "b", "c", "d"]), None, np.zeros((2, 2)), [_Opaque()] * 4][kind]


def bad_metrics(kind: int) -> Any:
    return [{1: 2.0}, [("loss", 1.0)], {}, None, {("loss",): 1.0, "loss": math.nan}][kind]


def apply_bad(mon: Monitor, actions: list[tuple[str, Any, int]], rng: np.random.Generator,
              step: int) -> int:
    """Feed the bad section; returns the last valid step used."""
    for kind, a, b in actions:
        if kind == "value":
            m, _ = finite_step(rng, step, spike=False)
            # only the bad value is sent for that name; every other value on the step is bad too
            metrics = {a: BAD_VALUES[b], "loss": math.nan}
            step += 1
            mon.observe(step, metrics)
        elif kind == "step":
            bad = BAD_STEPS[a]
            if bad == "REPEAT":
                bad = step
            elif bad == "BACK":
                bad = max(step - 5, 0)
            m, fam = finite_step(rng, step, spike=True)  # finite values that must NOT be used
            mon.observe(bad, m, families=fam)
        elif kind == "family":
            step += 1
            mon.observe(step, {"loss": math.inf}, families={a: bad_family(b)})
        elif kind == "metrics":
            step += 1
            mon.observe(step, bad_metrics(a))
        else:
            step += a
            mon.observe(step, {})
    return step


def alarms_of(decisions: list[Any]) -> list[tuple[Any, ...]]:
    return [(d.step, tuple(sorted((a.detector, a.signal, a.kind, a.severity, a.score)
                                  for a in d.alarms))) for d in decisions]


def assert_state_finite(mon: Monitor) -> None:
    sd_bindings = mon._bindings  # white-box: every bank's state arrays
    for b in sd_bindings:
        st_ = b.det._state
        fresh = b.det._init_state(st_.shape[1])  # sentinel fields (e.g. +-inf minima) allowed
        bad = ~np.isfinite(st_) & np.isfinite(fresh)
        assert not bad.any(), f"{b.name}: non-finite state fields {np.argwhere(bad)[:4].tolist()}"


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**20), actions=st.lists(bad_action, min_size=1, max_size=30),
       spikes=st.lists(st.integers(0, N_SUFFIX - 1), max_size=4))
def test_bad_section_does_not_change_later_alarms(seed: int, actions: list[Any],
                                                  spikes: list[int]) -> None:
    rng_data = np.random.default_rng(seed)
    prefix = [finite_step(rng_data, s) for s in range(N_PREFIX)]
    suffix_data = [finite_step(rng_data, N_PREFIX + s, spike=s in spikes) for s in range(N_SUFFIX)]
    a, b = make_monitor(), make_monitor()
    for s, (m, fam) in enumerate(prefix):
        a.observe(s, m, families=fam)
        b.observe(s, m, families=fam)
    last = apply_bad(a, actions, np.random.default_rng(seed + 1), N_PREFIX - 1)
    start = last + 1
    da, db = [], []
    for i, (m, fam) in enumerate(suffix_data):
        da.append(a.observe(start + i, m, families=fam))
        db.append(b.observe(start + i, m, families=fam))
    assert alarms_of(da) == alarms_of(db)
    assert all(not d.skipped for d in da)
    assert_state_finite(a)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**20), actions=st.lists(bad_action, min_size=1, max_size=40),
       log_only=st.booleans())
def test_observe_never_raises_in_non_strict_mode(seed: int, actions: list[Any],
                                                 log_only: bool) -> None:
    rng = np.random.default_rng(seed)
    mon = make_monitor(log_only=log_only)
    step = -1
    for chunk in range(3):
        for _ in range(40):
            step += 1
            m, fam = finite_step(rng, step, spike=rng.random() < 0.02)
            mon.observe(step, m, families=fam)
        step = apply_bad(mon, actions, rng, step)
        mon.rewind(step) if chunk == 1 else None
    assert_state_finite(mon)
    # the state survives a JSON round trip after all that
    import json

    sd = json.loads(json.dumps(mon.state_dict(), allow_nan=False))
    clone = make_monitor(log_only=log_only)
    clone.load_state_dict(sd)
    m, fam = finite_step(rng, step + 1)
    assert alarms_of([mon.observe(step + 1, m, families=fam)]) == alarms_of(
        [clone.observe(step + 1, m, families=fam)])


def test_families_change_size_and_metrics_come_and_go() -> None:
    rng = np.random.default_rng(0)
    mon = make_monitor(log_only=False)
    s = 0
    for layers in (LAYERS, LAYERS + ["blk4", "blk5"], ["blk5", "blk0"], [], LAYERS[:1]):
        for f in FAMILIES:
            mon.declare_family(f, layers)
        for _ in range(60):
            m, _fam = finite_step(rng, s)
            fam = {f: np.abs(1.0 + 0.05 * rng.standard_normal(len(layers))) for f in FAMILIES}
            if s % 7 == 0:
                m.pop("grad_norm")  # disappears
            if s % 11 == 0:
                m[f"extra/{s}"] = 1.0  # appears once
            d = mon.observe(s, m, families=fam)
            assert not d.skipped, d.skipped
            s += 1
    assert "grad_norm/blk5" in mon.signals
    assert_state_finite(mon)
    # a family array of the old size is rejected (reported), not fed
    d = mon.observe(s, {}, families={"act_mean": np.zeros(4)})
    assert d.skipped


def test_huge_steps_and_gaps() -> None:
    mon = make_monitor(log_only=False)
    rng = np.random.default_rng(1)
    steps = [0, 1, 10**6, 10**6 + 1, 2 * 10**6, 2**40, 2**53 - 2]
    for s in steps:
        m, fam = finite_step(rng, 0)
        d = mon.observe(s, m, families=fam)
        assert not d.skipped and d.step == s
    # beyond 2**53 - 1 (float64's exact integers): a recorded skip that never becomes last_step
    for huge in (2**53, 2**63, 10**30, 1e20):
        d = mon.observe(huge, {"loss": 1.0})
        assert d.skipped and "largest accepted step" in d.skipped[0]
    assert mon.last_step == 2**53 - 2
    d = mon.observe(2**53 - 1, {"loss": math.nan})
    assert not d.skipped and [a.kind for a in d.alarms] == ["nonfinite"]
