"""Tests of the healthy-checkpoint ledger and the retention helper (stability/checkpoints.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stability.checkpoints import CheckpointLedger, CheckpointRecord, retention_plan


def test_latest_healthy_before_skips_flagged_and_tainted() -> None:
    led = CheckpointLedger(margin=3)
    led.add(10, "a")
    led.add(20, "b", healthy=False, reason="emergency")
    led.add(30, "c")
    led.add(40, "d")
    led.note_alarm(32)
    assert led.latest_healthy_before(45).path == "d"
    # 43 - margin excludes 'd'; 'c' is tainted by the alarm 2 steps after it; 'b' is flagged
    assert led.latest_healthy_before(43).path == "a"
    assert not led.is_healthy(led.records[2]) and led.is_healthy(led.records[3])
    assert led.latest_healthy_before(10) is None
    assert led.latest_healthy_before(45, margin=0).path == "d"


def test_covers_step_is_what_matters() -> None:
    led = CheckpointLedger()
    led.add(100, "saved-late", covers_step=90)
    assert led.latest_healthy_before(95).path == "saved-late"
    assert led.records[0].covers == 90


def test_note_alarm_merges_intervals() -> None:
    led = CheckpointLedger()
    for s in (5, 6, 7, 9, 8, 20, 20):
        led.note_alarm(s)
    led.note_alarm(30, 35)
    assert led.state_dict()["alarms"] == [[5, 9], [20, 20], [30, 35]]
    led.note_alarm(10, 19)
    assert led.state_dict()["alarms"] == [[5, 20], [30, 35]]
    assert led.alarm_near(33) and not led.alarm_near(25) and led.alarm_near(25, margin=5)


def test_rewind_drops_the_abandoned_timeline() -> None:
    led = CheckpointLedger()
    for s in (100, 200, 300):
        led.add(s, str(s))
    led.note_alarm(250, 320)
    dropped = led.rewind(200)
    assert [r.step for r in dropped] == [300]
    assert [r.step for r in led.records] == [100, 200]
    assert led.state_dict()["alarms"] == []
    led.add(250, "new")
    assert led.latest_healthy_before(260).path == "new"


def test_round_trip_json() -> None:
    led = CheckpointLedger(margin=2)
    led.add(1, "x", reason="periodic")
    led.add(5, "y", healthy=False, reason="emergency: loss_spike", covers_step=4)
    led.note_alarm(4)
    sd = json.loads(json.dumps(led.state_dict()))
    assert sd["version"] == 1
    led2 = CheckpointLedger.from_state_dict(sd)
    assert led2.records == led.records and led2.margin == 2
    assert led2.state_dict() == led.state_dict()
    assert CheckpointRecord.from_dict({"step": 3, "path": "p"}).covers == 3


def test_bad_margin() -> None:
    with pytest.raises(ValueError, match="margin"):
        CheckpointLedger(margin=-1)
    with pytest.raises(ValueError):
        retention_plan([1, 2], growth=1.0)


def test_retention_keeps_recent_dense_old_sparse() -> None:
    steps = list(range(0, 100_001, 500))
    doomed = set(retention_plan(steps, keep_last=4, interval=1000, growth=2.0))
    kept = sorted(set(steps) - doomed)
    assert kept[-4:] == steps[-4:]
    assert kept[0] == 0                   # the oldest survives
    assert len(kept) <= 4 + 10            # ~ log2(100k / 1k) + 1 buckets


def test_ledger_retention_protects_latest_healthy() -> None:
    led = CheckpointLedger()
    led.add(0, "h0")
    for s in range(100, 1100, 100):
        led.add(s, f"u{s}", healthy=False)
    gone = led.retention(keep_last=2, interval=100, growth=2.0)
    assert all(r.path != "h0" for r in gone)
    assert led.latest_healthy_before(10_000).path == "h0"
    assert len(led) + len(gone) == 11


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(0, 10_000), max_size=60), st.integers(0, 5), st.integers(1, 500))
def test_retention_plan_properties(steps: list[int], keep_last: int, interval: int) -> None:
    doomed = retention_plan(steps, keep_last, interval, 2.0)
    uniq = sorted(set(steps))
    assert set(doomed) <= set(uniq)
    kept = [s for s in uniq if s not in doomed]
    assert kept[-keep_last:] == uniq[-keep_last:] if keep_last else True
    if uniq:
        assert kept and kept[-1 if keep_last else 0] in uniq
    # idempotent: applying the plan again deletes nothing more among the recent ones
    again = retention_plan(kept, keep_last, interval, 2.0)
    assert not set(again) & set(uniq[-keep_last:] if keep_last else [])
