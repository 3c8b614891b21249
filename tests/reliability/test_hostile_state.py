"""Hostile or stale state dicts: checked before use, config hyperparameters win, never a crash.

* random tampering of any field of a real monitor snapshot (hypothesis; the loads run in a child
  process, so a segmentation fault fails this test instead of killing the suite) gives either a
  ``ValueError`` at load time or a monitor whose next ``observe()`` works;
* a snapshot taken under a threshold of 6.0 and loaded into a monitor configured with 3.0 alarms
  exactly as a monitor built with 3.0 and fed the same history;
* ``strict=False`` re-warms the incompatible parts with a warning and keeps the rest;
* the tampering the adversarial pass found (ring index out of range, NaN thresholds, alpha 7,
  negative windows, NaN LR factors) is rejected or overridden by the config.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detectors import EWMAZScore, RobustZScore
from stability import Monitor
from stability.policy.policy import Policy

from .conftest import long_enabled

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CHILD = HERE / "_hostile_state_child.py"

# ------------------------------------------------------------------ random tampering (child)
values = st.one_of(
    st.integers(min_value=0, max_value=40),                 # index into the child's constants
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
)
plan = st.tuples(st.integers(min_value=0, max_value=10**7), st.integers(0, 5), values)
N_PLANS = 600 if long_enabled() else 150


def run_child(plans: list[tuple[int, int, Any]]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(CHILD)], input=json.dumps(plans), text=True,
                          capture_output=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative: killed by a signal, e.g. SIGSEGV)\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


# (hypothesis starts with the minimal example, all plans equal: 3 examples for 2 varied ones)
@settings(max_examples=8 if long_enabled() else 3, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.lists(plan, min_size=N_PLANS, max_size=N_PLANS))
def test_random_tampering_never_crashes(plans: list[tuple[int, int, Any]]) -> None:
    out = run_child(plans).split()
    assert out[0] == "OK", out
    loaded, rejected = int(out[1]), int(out[2])
    assert loaded + rejected > 0
    if len({repr(p) for p in plans}) > 1:
        assert rejected > 0  # the tampering does reach the checks


# ------------------------------------------------------------------ precedence: config wins
def spike_config(threshold: float) -> dict[str, Any]:
    return {"preset": "default",
            "detectors": [{"name": "loss_spike", "params": {"threshold": threshold}}]}


def quiet_history(n: int = 200) -> list[tuple[int, dict[str, float]]]:
    rng = np.random.default_rng(3)
    return [(s, {"loss": 2.0 * math.exp(0.003 * rng.standard_normal()), "grad_norm": 1.0})
            for s in range(n)]


def spiky_tail(start: int, n: int = 120) -> list[tuple[int, dict[str, float]]]:
    rng = np.random.default_rng(4)
    out = []
    for s in range(start, start + n):
        x = 2.0 * math.exp(0.003 * rng.standard_normal())
        if s % 30 == 10:
            x *= math.exp(4.5 * 0.12)  # z ~ 4.5 over the 0.12 noise floor: in (3.0, 6.0)
        out.append((s, {"loss": x, "grad_norm": 1.0}))
    return out


def alarm_steps(decisions: list[Any]) -> list[tuple[int, str]]:
    return [(d.step, a.detector) for d in decisions for a in d.alarms]


def test_config_threshold_wins_over_the_snapshot() -> None:
    history = quiet_history()
    tail = spiky_tail(len(history))
    snap_mon = Monitor(spike_config(6.0), alert_sinks=[])
    ref = Monitor(spike_config(3.0), alert_sinks=[])
    for s, m in history:
        assert snap_mon.observe(s, m).healthy and ref.observe(s, m).healthy
    sd = json.loads(json.dumps(snap_mon.state_dict()))
    resumed = Monitor(spike_config(3.0), alert_sinks=[])
    resumed.load_state_dict(sd)
    assert resumed.config.detectors[[d.name for d in resumed.config.detectors].index(
        "loss_spike")].params["threshold"] == 3.0
    assert resumed.detector("loss_spike").threshold == 3.0
    got = [resumed.observe(s, m) for s, m in tail]
    want = [ref.observe(s, m) for s, m in tail]
    old = [snap_mon.observe(s, m) for s, m in tail]
    assert got == want
    assert alarm_steps(got) != alarm_steps(old)  # 6.0 would not have alarmed on these
    assert any(det == "loss_spike" for _, det in alarm_steps(got))


def test_detector_keeps_its_own_hyperparameters() -> None:
    src = EWMAZScore(alpha=0.5, threshold=6.0, warmup=3)
    src.update_many(np.exp(np.random.default_rng(0).normal(0, 0.01, 50)))
    sd = src.state_dict()
    sd["params"] = {**sd["params"], "alpha": 7.0, "threshold": math.nan, "warmup": -4}
    det = EWMAZScore(alpha=0.1, threshold=3.0, warmup=3)
    det.load_state_dict(sd)
    assert (det.alpha, det.threshold, det.warmup) == (0.1, 3.0, 3)
    np.testing.assert_array_equal(det.mean, src.mean)
    # from_state_dict is the way to continue with the snapshot's own hyperparameters
    clone = EWMAZScore.from_state_dict(src.state_dict())
    assert (clone.alpha, clone.threshold) == (0.5, 6.0)


# ------------------------------------------------------------------ the defects found
def fed_robust() -> RobustZScore:
    det = RobustZScore(n_series=2, window=16)
    det.update_many(np.exp(np.random.default_rng(1).normal(0, 0.05, (40, 2))))
    return det


@pytest.mark.parametrize(("row", "value", "field"), [
    (0, 1e6, "window position"), (0, -1.0, "window position"), (1, 17.0, "window count"),
    (1, math.nan, "window count"), (0, 2.5, "window position"), (0, 9.2e18, "window position"),
])
def test_ring_index_out_of_range_is_rejected(row: int, value: float, field: str) -> None:
    sd = fed_robust().state_dict()
    sd["state"][row, 1] = value
    det = RobustZScore(n_series=2, window=16)
    with pytest.raises(ValueError, match=f"RobustZScore.*'{field}'"):
        det.load_state_dict(sd)
    np.testing.assert_array_equal(det.count, [0.0, 0.0])  # unchanged


@pytest.mark.parametrize("mutate", [
    lambda sd: sd.update(buf=sd["buf"][:-1]),                       # wrong shape
    lambda sd: sd.update(state=sd["state"].astype(str)),              # wrong dtype
    lambda sd: sd.update(state=sd["state"].tolist()[:1]),             # ragged / short
    lambda sd: sd.pop("state"),                                       # missing key
    lambda sd: sd.update(params={**sd["params"], "window": -8}),      # negative window
    lambda sd: sd.update({"class": "EWMAZScore"}),                    # another class
    lambda sd: sd.update(version=99),
])
def test_malformed_detector_snapshots_are_rejected(mutate: Any) -> None:
    sd = fed_robust().state_dict()
    mutate(sd)
    with pytest.raises(ValueError, match="RobustZScore.load_state_dict"):
        RobustZScore(n_series=2, window=16).load_state_dict(sd)


@pytest.mark.parametrize(("key", "value", "field"), [
    ("lr", [10, math.nan, 100, 50], "lr[1]"),
    ("lr", [10, -0.5, 100, 50], "lr[1]"),
    ("lr", [10, 0.5, -100, 50], "lr[2]"),
    ("lr", [10, 0.5], "lr"),
    ("jump", [2.0, 5, 7.0], "jump[2]"),
    ("n_rollbacks", -1, "n_rollbacks"),
    ("level", "2", "level"),
    ("version", 99, "version"),
])
def test_policy_rejects_bad_fields(key: str, value: Any, field: str) -> None:
    pol = Policy()
    sd = pol.state_dict()
    sd[key] = value
    pattern = "newer" if key == "version" else "Policy.*'" + field.replace("[", r"\[")
    with pytest.raises(ValueError, match=pattern):
        pol.load_state_dict(sd)
    assert pol.state_dict() == Policy().state_dict()  # unchanged


def fed_monitor(cfg: Any = None) -> tuple[Monitor, dict[str, Any]]:
    mon = Monitor(cfg, alert_sinks=[])
    rng = np.random.default_rng(2)
    for s in range(120):
        mon.observe(s, {"loss": 2.0 + 0.01 * rng.random(), "grad_norm": 1.0 + 0.1 * rng.random(),
                        "lr": 1e-3, "grad_norm/h0": 0.5 + 0.01 * rng.random(),
                        "grad_norm/h1": 0.7 + 0.01 * rng.random()})
    return mon, json.loads(json.dumps(mon.state_dict()))


def bank(sd: dict[str, Any], name: str) -> dict[str, Any]:
    return next(b for b in sd["bindings"] if b["name"] == name)


def test_monitor_rejects_a_tampered_bank_and_stays_unchanged() -> None:
    _, sd = fed_monitor()
    mon, before = fed_monitor()
    bad = copy.deepcopy(sd)
    bank(bad, "loss_spike_robust")["detector"]["state"]["data"][0] = 10**9  # ring position
    with pytest.raises(ValueError, match="position.*loss_spike_robust"):
        mon.load_state_dict(bad)
    assert json.loads(json.dumps(mon.state_dict())) == before
    bad = copy.deepcopy(sd)
    bad["control"]["lr_factor"] = "nan"
    with pytest.raises(ValueError, match="control.lr_factor"):
        mon.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bank(bad, "grad_explosion_layers")["slots"] = [[10**12, -5]]  # slot indices are not trusted
    with pytest.raises(ValueError, match="grad_explosion_layers.*do not match"):
        mon.load_state_dict(bad)
    assert json.loads(json.dumps(mon.state_dict())) == before
    mon.observe(500, {"loss": 2.0, "grad_norm": 1.0})


# ------------------------------------------------------------------ strict=False re-warms
def test_detector_strict_false_rewarms_with_a_warning() -> None:
    sd = fed_robust().state_dict()
    sd["state"][0, 0] = 1e6
    det = RobustZScore(n_series=2, window=16)
    with pytest.warns(UserWarning, match="Re-warming"):
        det.load_state_dict(sd, strict=False)
    np.testing.assert_array_equal(det.count, [0.0, 0.0])
    det.update(np.ones(2))


def test_monitor_strict_false_rewarms_only_the_incompatible_parts() -> None:
    src, sd = fed_monitor()
    bad = copy.deepcopy(sd)
    bank(bad, "loss_spike_robust")["detector"]["state"]["data"][0] = -3.0
    bad["policy"]["lr"] = [1, math.inf, 2, 3]
    mon = Monitor(alert_sinks=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon.load_state_dict(bad, strict=False)
    text = " ".join(str(w.message) for w in caught)
    assert "loss_spike_robust" in text and "policy" in text
    assert mon.detector("loss_spike_robust").count.tolist() == [0.0]      # re-warmed
    np.testing.assert_array_equal(mon.detector("loss_spike")._state,      # kept (whatever
                                  src.detector("loss_spike")._state)      # the detector)
    assert mon.last_step == src.last_step
    mon.observe(mon.last_step + 1, {"loss": 2.0, "grad_norm": 1.0})


def test_monitor_strict_false_keeps_shared_series_by_name() -> None:
    src, sd = fed_monitor()
    swapped = copy.deepcopy(sd)
    i, j = swapped["slots"].index("grad_norm/h0"), swapped["slots"].index("grad_norm/h1")
    swapped["slots"][i], swapped["slots"][j] = swapped["slots"][j], swapped["slots"][i]
    with pytest.raises(ValueError, match="strict=False"):
        Monitor(alert_sinks=[]).load_state_dict(swapped)
    mon = Monitor(alert_sinks=[])
    with pytest.warns(UserWarning, match="Shared series keep their statistics"):
        mon.load_state_dict(swapped, strict=False)
    a, b = mon.detector("grad_explosion_layers"), src.detector("grad_explosion_layers")
    for key in ("h0", "h1"):
        ka = mon.series("grad_explosion_layers").index(key)
        kb = src.series("grad_explosion_layers").index(key)
        np.testing.assert_array_equal(a._state[:, ka], b._state[:, kb])
    assert mon.series("grad_explosion_layers") != src.series("grad_explosion_layers")
