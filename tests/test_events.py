"""Tests of the durable JSONL event log (stability/outputs/events.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stability.outputs import events as events_mod
from stability.outputs.events import EventLog, is_critical, iter_events, read_events
from stability.types import Alarm, Checkpoint, ReduceLR, Rollback, Stop


def test_round_trip_all_record_types(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "events.jsonl"
    with EventLog(p, clock=lambda: 123.0) as log:
        assert log.alarm(Alarm(1, "nonfinite", "loss", float("inf"), 0.5, "critical", "nf"))
        log.intervention(ReduceLR(2, "L2", factor=0.5))
        log.goodput(3, {"steps": 3, "goodput": 1.0})
        log.info(4, "note", value=float("nan"), arr=(1, 2))
        log.append({"type": "custom", "step": 5, "obj": object()})
    recs = read_events(p)
    assert [r["type"] for r in recs] == ["alarm", "intervention", "goodput", "info", "custom"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert all(r["time"] == 123.0 for r in recs)
    assert recs[0]["score"] == "inf" and Alarm.from_dict(recs[0]).score == float("inf")
    assert recs[1]["intervention"] == "reduce_lr" and recs[1]["factor"] == 0.5
    assert recs[3]["value"] == "nan" and recs[3]["arr"] == [1, 2]
    assert log.n_written == 5 and log.n_dropped == 0
    # appending to an existing log keeps what is there
    with EventLog(p) as log2:
        log2.info(6, "again")
    assert len(read_events(p)) == 6


def test_critical_classification() -> None:
    assert is_critical({"type": "intervention", "intervention": "rollback"})
    assert is_critical({"type": "stop"}) and is_critical({"type": "info", "critical": True})
    assert not is_critical({"type": "alarm", "severity": "warning"})
    assert not is_critical({"type": "intervention", "intervention": "reduce_lr"})


def test_fsync_only_on_critical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = os.fsync
    monkeypatch.setattr(events_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    log = EventLog(tmp_path / "e.jsonl")
    log.alarm(Alarm(1, "loss_spike", "loss", 7.0, 6.0, "warning", "d"))
    log.intervention(ReduceLR(1))
    assert calls == []
    log.alarm(Alarm(2, "loss_spike", "loss", 70.0, 6.0, "critical", "d"))
    log.intervention(Checkpoint(2, healthy=False))
    log.intervention(Rollback(2, to_step=1))
    log.intervention(Stop(2, "bye"))
    assert log.wait_synced(5.0)  # fsynced by the syncer thread, in groups
    assert 1 <= len(calls) <= 4
    log.close()
    log.close()  # idempotent
    # after close: dropped with a one-time warning, never raised into the training loop
    assert log.info(3, "late") is False and log.info(4, "later") is False
    assert log.n_dropped == 2


def test_torn_last_line_is_tolerated(tmp_path: Path) -> None:
    p = tmp_path / "e.jsonl"
    with EventLog(p) as log:
        for s in range(3):
            log.info(s, "x")
    with open(p, "ab") as f:
        f.write(b'{"type": "alarm", "step": 3, "sco')
    assert [r["step"] for r in read_events(p)] == [0, 1, 2]


def test_corrupt_middle_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "e.jsonl"
    p.write_text('{"type":"info","step":0}\nGARBAGE\n[1,2]\n{"type":"info","step":3}\n')
    with pytest.raises(ValueError, match=r"e.jsonl:2: corrupt"):
        read_events(p)
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_events(p, errors="skip")] == [0, 3]
    assert "corrupt" in caplog.text


def test_unwritable_location_reported_once(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.ERROR, logger="stability.events"):
        log = EventLog(blocker / "sub" / "events.jsonl")
        for s in range(5):
            assert log.info(s, "lost") is False
    assert log.n_dropped == 5
    assert sum("cannot be written" in r.message for r in caplog.records) == 1
    with pytest.raises(OSError):
        EventLog(blocker / "sub" / "events.jsonl", strict=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="stability.events"):
        log = EventLog("/dev/full", fsync="never")
        assert not log.info(1, "x") and not log.info(2, "y")
    assert log.n_dropped == 2
    assert sum("cannot be written" in r.message for r in caplog.records) == 1
    strict = EventLog("/dev/full", fsync="never", strict=True)
    with pytest.raises(OSError):
        strict.info(1, "x")


def test_concurrent_appends_stay_whole(tmp_path: Path) -> None:
    p = tmp_path / "e.jsonl"
    log = EventLog(p, fsync="never")

    def work(k: int) -> None:
        for s in range(200):
            log.info(s, "x" * (k * 50), thread=k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    recs = read_events(p)
    assert len(recs) == 800 and {r["thread"] for r in recs} == {0, 1, 2, 3}


_CHILD = r"""
import os, signal, sys
from stability.outputs.events import EventLog
from stability.types import Alarm, Rollback
log = EventLog(sys.argv[1])
for s in range(50):
    log.info(s, "routine")
log.alarm(Alarm(50, "nonfinite", "loss", float("nan"), 0.5, "critical", "nf"))
log.intervention(Rollback(50, "L3", to_step=40, skip_from=45, skip_to=50))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_no_event_lost_when_killed_right_after_append(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(p)], timeout=60,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    recs = read_events(p)
    assert len(recs) == 52
    assert recs[-2]["type"] == "alarm" and recs[-1]["intervention"] == "rollback"
    assert recs[-1]["to_step"] == 40 and json.loads(p.read_text().splitlines()[-1])["step"] == 50


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^The 'fsync' parameter of EventLog must be one of "
                       r"\['always', 'critical', 'never'\]\. Got 'sometimes' instead\.$"):
        EventLog(tmp_path / "e", fsync="sometimes")
    with pytest.raises(ValueError, match=r"'strict' parameter of EventLog must be a bool\. Got "
                       r"'yes' instead"):
        EventLog(tmp_path / "e", strict="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^The 'errors' parameter of read_events must be one "
                       r"of \['raise', 'skip'\]\. Got 'ignore' instead\.$"):
        read_events(tmp_path / "e", errors="ignore")
    with pytest.raises(ValueError, match=r"'errors' parameter of iter_events .* Got 'x' instead"):
        next(iter_events(tmp_path / "e", errors="x"))
    assert not (tmp_path / "e").exists()  # rejected before anything was created
