"""Tests of goodput accounting (stability/goodput.py)."""

from __future__ import annotations

import json
import math

from stability.events import EventLog, read_events
from stability.goodput import GoodputTracker
from stability.types import Control


def test_counts_from_control() -> None:
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    g = GoodputTracker(clock=clock)
    for s in range(100):
        c = Control()
        c.skip_step = s in (10, 11)
        c.lr_factor = 0.5 if 20 <= s < 40 else 1.0
        c.clip_norm = 1.0 if 30 <= s < 50 else None
        if s == 60:
            c.rollback_to = 45
        g.update_from_control(s, c)
    assert g.steps == 100 and g.skipped == 2 and g.degraded_steps == 30
    assert g.lost == 15 and g.rollbacks == 1
    assert g.productive == 83 and math.isclose(g.fraction, 0.83)
    assert g.time_total == 99.0 and g.time_degraded == 30.0 and g.time_skipped == 2.0


def test_empty_and_round_trip() -> None:
    g = GoodputTracker()
    assert math.isnan(g.fraction) and g.summary()["goodput"] is None
    g.update(1, skipped=True)
    g.update(2, degraded=True)
    g.note_rollback(2, 0)
    sd = json.loads(json.dumps(g.state_dict()))
    h = GoodputTracker()
    h.load_state_dict(sd)
    assert h.summary() == g.summary() and sd["version"] == 1
    h.load_state_dict({"version": 1})        # later fields default
    assert h.steps == 0


def test_goodput_record_in_event_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = GoodputTracker()
    for s in range(5):
        g.update(s, skipped=s == 2)
    with EventLog(tmp_path / "ev.jsonl") as log:
        log.append(g.record())
        log.goodput(4, g.summary())
    recs = read_events(tmp_path / "ev.jsonl")
    assert [r["type"] for r in recs] == ["goodput", "goodput"]
    assert recs[0]["step"] == 4 and recs[0]["productive"] == 4 and recs[1]["goodput"] == 0.8
