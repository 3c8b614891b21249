"""Tests of goodput accounting (stability/run/goodput.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from stability.outputs.events import EventLog, read_events
from stability.run.goodput import GoodputTracker
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


def test_a_step_skipped_by_the_trainer_is_counted_skipped() -> None:
    t = [0.0]
    g = GoodputTracker(clock=lambda: t[0])
    g.start()
    for s in range(4):
        t[0] += 2.0
        g.update(s)
    assert g.mark_skipped(3) and not g.mark_skipped(3) and not g.mark_skipped(2)
    assert (g.skipped, g.productive, g.time_skipped) == (1, 3, 2.0)
    assert g.time_buckets()["productive"] == 6.0
    g.note_rollback(3, 1)                    # steps 2, 3 lost: only 2's time was productive
    assert g.time_buckets()["rollback"] == 2.0 and g.productive == 1


def test_batches_and_failed_checkpoints_are_counted_and_kept() -> None:
    g = GoodputTracker()
    g.note_batch_skipped(3)
    g.note_batch_skipped()
    g.note_checkpoint_failed()
    s = g.summary()
    assert (s["batches_skipped"], s["checkpoint_failures"]) == (4, 1)
    h = GoodputTracker()
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert (h.batches_skipped, h.checkpoint_failures) == (4, 1)
    h.load_state_dict({"version": 1, "steps": 2})   # snapshots before the fields: 0
    assert (h.batches_skipped, h.checkpoint_failures, h.steps) == (0, 0, 2)
    with pytest.raises(ValueError, match="batches_skipped"):
        h.load_state_dict({"version": 1, "batches_skipped": -1})


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


# ---------------------------------------------------------------------------- time ledger
class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def test_time_buckets_add_up_to_measured_wall_time() -> None:
    """A scripted run (steps, skips, saves, a rollback, stalls, evaluation, a crash and a
    resume) on an injected clock: every bucket matches the script's own bookkeeping, and
    together they are the measured wall time."""
    import copy
    import random

    rng = random.Random(3)
    clock = Clock()
    t_start = clock.t
    # the script's ledger: overheads by bucket, counts, and the steps of the live timeline
    book: dict[str, Any] = {"other": 0.0, "checkpoint": 0.0, "stall": 0.0, "rollback": 0.0,
                            "skipped": 0.0, "stalls": 0, "checkpoints": 0, "timeline": []}
    saved: dict[str, Any] = {}

    def run(g: GoodputTracker, steps: range, crash_at: int | None = None) -> None:
        nonlocal saved
        for s in steps:
            if s == crash_at:
                return
            dt = rng.uniform(0.5, 1.5)
            skipped = s % 37 == 5
            clock.t += dt
            if s % 50 == 17:                       # a stall noted on recovery, before update
                clock.t += 30.0
                g.note_stall(30.0)
                book["stall"] += 30.0
                book["stalls"] += 1
            if s % 45 == 44:                       # evaluation between steps
                clock.t += 4.0
                g.note_other(4.0)
                book["other"] += 4.0
            g.update(s, skipped=skipped)
            book["timeline"].append((s, dt, skipped))
            book["skipped"] += dt if skipped else 0.0
            if s % 40 == 39:                       # a 3 s checkpoint save after the step
                clock.t += 3.0
                g.note_checkpoint(3.0)
                book["checkpoint"] += 3.0
                book["checkpoints"] += 1
                saved = {"state": json.loads(json.dumps(g.state_dict())),
                         "book": copy.deepcopy(book), "t": clock.t}
            if s == 130:                           # a rollback to step 100 (restore: 2 s)
                tl = book["timeline"]
                book["rollback"] += sum(d for st, d, sk in tl if st > 100 and not sk) + 2.0
                book["timeline"] = [x for x in tl if x[0] <= 100]
                clock.t += 2.0
                g.note_rollback(130, 100, seconds=2.0)
                return

    g = GoodputTracker(clock=clock)
    g.start()
    run(g, range(0, 131))                          # ... rollback at 130 ...
    run(g, range(101, 260), crash_at=233)          # ... crash at step 233 (last save: 199)
    # the process dies: what it did since the last save is lost with it
    lost_s = clock.t - saved["t"]
    restart_s = 45.0
    clock.t += restart_s
    book = saved["book"]
    g2 = GoodputTracker(clock=clock)
    g2.load_state_dict(saved["state"])
    g2.note_restart(restart_s, lost_s=lost_s)
    g2.start()
    run(g2, range(200, 300))
    clock.t += 7.0                                 # shutdown after the last step
    g2.sync()

    measured = clock.t - t_start
    want = {"productive": sum(d for _, d, sk in book["timeline"] if not sk),
            "skipped": book["skipped"], "rollback": book["rollback"],
            "checkpoint": book["checkpoint"], "restart": restart_s + lost_s,
            "stall": book["stall"], "other": book["other"] + 7.0}
    assert sum(want.values()) == pytest.approx(measured, rel=1e-9)   # the script is complete
    got = g2.time_buckets()
    assert sum(got.values()) == pytest.approx(measured, rel=0.01)
    assert g2.wall_time == pytest.approx(measured, rel=1e-9)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=0.01, abs=1e-9), k
    s = g2.summary()
    assert sum(s["time_fraction"].values()) == pytest.approx(1.0)
    assert s["goodput_time"] == pytest.approx(want["productive"] / measured)
    assert (s["restarts"], s["stalls"], s["checkpoints"]) == (1, book["stalls"],
                                                              book["checkpoints"])


def test_noted_time_is_carved_out_of_the_interval_it_happened_in() -> None:
    c = Clock()
    g = GoodputTracker(clock=c)
    g.start()
    c.t += 10.0
    g.note_checkpoint(4.0)                 # during the first step's interval
    g.update(1)
    assert g.time_buckets()["productive"] == 6.0 and g.wall_time == 10.0
    g.note_stall(3.0)                      # reported after the interval closed: next one
    c.t += 5.0
    g.update(2)
    b = g.time_buckets()
    assert b["productive"] == 8.0 and b["stall"] == 3.0 and g.wall_time == 15.0
    assert g.unsaved_s == 8.0              # the save came before step 1 completed
    g.note_rollback(2, 1)                  # the recompute of step 2
    assert g.time_buckets()["rollback"] == 2.0 and g.unsaved_s == 6.0
    g.note_checkpoint(1.0)
    assert g.unsaved_s == 0.0


def test_rollback_price_after_restore_uses_mean_step_time() -> None:
    c = Clock()
    g = GoodputTracker(clock=c)
    g.start()
    for s in range(10):
        c.t += 2.0
        g.update(s)
    h = GoodputTracker(clock=c)
    h.load_state_dict(g.state_dict())
    h.note_rollback(9, 6)                  # no per-step history after a restore
    assert h.time_lost == pytest.approx(6.0) and h.lost == 3


def test_format_goodput() -> None:
    from stability.run.goodput import format_goodput

    assert "no goodput records" in format_goodput([{"type": "alarm"}])
    c = Clock()
    g = GoodputTracker(clock=c)
    g.start()
    for s in range(4):
        c.t += 10.0
        g.update(s, skipped=s == 0)
    c.t += 60.0
    g.note_restart(60.0)
    g.sync()
    text = format_goodput([{"type": "goodput", "steps": 1, "productive": 1, "goodput": 1.0},
                           {"type": "stall", "step": 1}, g.record()])
    lines = text.splitlines()
    assert lines[0].startswith("goodput at step 3: 75.0% of steps productive (3 of 4)")
    assert "30.0% of wall time" in lines[0] and "1m40s" in lines[1] and "1 stalls" in lines[1]
    row = {ln.split()[0]: ln.split()[1:3] for ln in lines[2:]}
    assert row["productive"] == ["30.0s", "30.0%"] and row["restart"] == ["1m00s", "60.0%"]
    # an old record (steps only) still prints
    assert format_goodput([{"type": "goodput", "step": 9, "steps": 10, "productive": 8,
                            "goodput": 0.8}]).startswith("goodput at step 9: 80.0%")


def test_cli_goodput_prints_the_breakdown_of_an_event_log(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from replay.cli import main
    from stability.outputs.events import EventLog

    g = GoodputTracker(clock=iter([0.0, 10.0, 20.0, 35.0, 40.0]).__next__)
    g.start()
    g.update(1)
    g.note_checkpoint(5.0)
    g.update(2, skipped=True)
    g.update(3)
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.append(g.record())
    assert main(["goodput", str(path)]) == 0
    out = capsys.readouterr().out
    assert "goodput at step 3" in out and "checkpoint" in out and "skipped" in out
    assert main(["goodput", str(path), "--json"]) == 0
    assert '"productive": 2' in capsys.readouterr().out
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    assert main(["goodput", str(empty), "--json"]) == 1
