"""Tests of the healthy-checkpoint ledger and the retention helper
(stability/run/checkpoints.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stability.run.checkpoints import (
    CheckpointFiles,
    CheckpointLedger,
    CheckpointRecord,
    keep_last_plan,
    retention_plan,
)


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


# ------------------------------------------------------------------ the one registry
class _Files:
    """A store stand-in: which checkpoints exist, which were deleted (in order)."""

    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.deleted: list[int] = []

    def exists(self, rec: CheckpointRecord) -> bool:
        return rec.path in self.present

    def delete(self, rec: CheckpointRecord) -> None:
        self.deleted.append(rec.step)
        if rec.managed:
            self.present.discard(rec.path)


def _ledger(steps: list[int], managed: bool = True) -> tuple[CheckpointLedger, _Files]:
    led = CheckpointLedger()
    files = _Files({f"c{s}" for s in steps})
    led.attach(files)
    for s in steps:
        led.add(s, f"c{s}", managed=managed, data_position=s + 1)
    return led, files


def test_every_record_leaving_the_ledger_is_deleted_with_it() -> None:
    led, files = _ledger([10, 20, 30, 40, 50, 60])
    assert isinstance(files, CheckpointFiles) and led.files is files
    led.forget(10)
    led.rewind(50)                                   # drops 60
    gone = led.prune(keep=2)                         # keeps 40, 50
    assert [r.step for r in gone] == [20, 30]
    assert files.deleted == [10, 60, 20, 30]
    assert [r.step for r in led.records] == [40, 50] and files.present == {"c40", "c50"}
    files.present.add("c50-new")
    led.add(50, "c50-new", managed=True)             # same step, new file: the old one goes
    assert files.deleted[-1] == 50 and led.get(50).path == "c50-new"
    assert files.present == {"c40", "c50-new"}
    # a snapshot load deletes nothing (the store reconciles with the files instead)
    sd = led.state_dict()
    led.load_state_dict({"version": 1, "records": [], "alarms": []})
    led.load_state_dict(sd)
    assert files.deleted[-1] == 50 and len(files.deleted) == 5
    led.detach(files)
    led.forget(40)
    assert len(files.deleted) == 5 and led.files is None


def test_a_missing_checkpoint_is_never_a_rollback_target() -> None:
    led, files = _ledger([100, 200, 300])
    files.present.discard("c300")                    # deleted behind the ledger's back
    assert led.latest_healthy_before(400).step == 200
    assert [r.step for r in led.records] == [100, 200]
    files.present.discard("c100")
    assert led.get(100) is None and [r.step for r in led.records] == [200]
    files.present.discard("c200")
    assert [r.step for r in led.verify()] == [200] and led.latest_healthy_before(400) is None


def test_prune_only_touches_managed_records_and_judges_health_by_the_ledger() -> None:
    led, files = _ledger([10, 20, 30, 40])
    led.add(25, "c25")                               # the trainer's own: never pruned
    files.present.add("c25")
    led.note_alarm(41)                               # 40 is now unhealthy (margin 1)
    gone = led.prune(keep=1, margin=1)
    # newest healthy managed (30), newest unhealthy (40), the unmanaged 25
    assert [r.step for r in gone] == [10, 20]
    assert [r.step for r in led.records] == [25, 30, 40]
    assert led.prune(keep=1, protect={30}) == []


def test_state_round_trip_keeps_positions_and_ownership() -> None:
    led, _ = _ledger([1, 2], managed=True)
    led.add(3, "trainer", data_position=7)
    sd = json.loads(json.dumps(led.state_dict()))
    back = CheckpointLedger.from_state_dict(sd)
    assert back.records == led.records
    assert [(r.data_position, r.managed) for r in back.records] == [(2, True), (3, True),
                                                                     (7, False)]
    old = {"version": 1, "records": [{"step": 5, "path": "p"}, {"step": 5, "path": "q"}]}
    back.load_state_dict(old)                        # older snapshots: defaults; one per step
    assert [(r.path, r.data_position, r.managed) for r in back.records] == [("q", 0, False)]
    with pytest.raises(ValueError, match="data_position"):
        back.load_state_dict({"version": 1, "records": [{"step": 1, "path": "p",
                                                         "data_position": -1}]})


@settings(deadline=None, max_examples=80)
@given(st.lists(st.tuples(st.integers(0, 300), st.booleans()), max_size=30,
                unique_by=lambda t: t[0]),
       st.integers(0, 5), st.sets(st.integers(0, 300), max_size=3))
def test_keep_last_plan_properties(recs: list[tuple[int, bool]], keep: int,
                                   protect: set[int]) -> None:
    records = [CheckpointRecord(s, f"c{s}", healthy=h) for s, h in recs]
    doomed = keep_last_plan(records, keep, protect)
    good = sorted(s for s, h in recs if h)
    bad = sorted(s for s, h in recs if not h)
    kept = {s for s, _ in recs} - set(doomed)
    # reference: the newest `keep` healthy, the newest unhealthy, the protected ones
    want = set(good[len(good) - keep:] if keep and len(good) >= keep else good if keep else [])
    want |= set(bad[-1:]) | (protect & {s for s, _ in recs})
    assert kept == want and doomed == sorted(doomed)
    assert keep_last_plan([r for r in records if r.step in kept], keep, protect) == []
