"""Recovering alarms: an excursion already on its way back is reported as recovering."""

from __future__ import annotations

import json

import numpy as np

from stability.monitor.monitor import Monitor
from stability.types import Alarm

CFG = {"detectors": [{"name": "loss_level", "detector": "ratio", "inputs": ["loss"],
                      "kind": "level_shift", "critical_factor": 1.5,
                      "params": {"window": 100, "patience": 10, "reference": "median",
                                 "threshold": 1.1}}]}


def _loss() -> np.ndarray:
    """3.0 with noise; at step 300 the loss jumps to 3x and comes back over 60 steps."""
    rng = np.random.default_rng(0)
    x = 3.0 * np.exp(0.01 * rng.standard_normal(500))
    x[300:360] *= np.linspace(3.0, 1.0, 60)
    return x


def _live(mon: Monitor, x: np.ndarray, start: int = 0) -> list[Alarm]:
    return [a for s in range(start, len(x)) for a in mon.observe(s, {"loss": float(x[s])}).alarms]


def test_the_first_alarms_escalate_and_the_receding_ones_are_recovering() -> None:
    alarms = _live(Monitor(CFG, alert_sinks=[]), _loss())
    assert alarms and alarms[0].step == 309 and not alarms[0].recovering
    assert alarms[0].severity == "critical"  # 2.7x > 1.5 x 1.1
    rec = [a for a in alarms if a.recovering]
    assert rec, "a receding excursion must be rated recovering"
    assert all(a.severity == "warning" and "(recovering)" in a.message for a in rec)
    first = rec[0].step
    assert all(a.recovering for a in alarms if a.step >= first)  # once back, it stays so
    assert Alarm.from_dict(json.loads(json.dumps(rec[0].to_dict()))) == rec[0]


def test_replay_and_a_restored_state_rate_alike() -> None:
    x = _loss()
    live = _live(Monitor(CFG, alert_sinks=[]), x)
    replayed = [a for d in Monitor(CFG, alert_sinks=[]).replay(
        {"step": np.arange(len(x)), "loss": x}).events() for a in d.alarms]
    assert replayed == live
    first = Monitor(CFG, alert_sinks=[])
    head = _live(first, x[:320])
    second = Monitor(CFG, alert_sinks=[])
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + _live(second, x, start=320) == live
