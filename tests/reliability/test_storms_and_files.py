"""Storms stay bounded; files are never destroyed or written through symlinks (issue 27,
items 6 and 8, and the alert-text part of 9).

* alert sinks coalesce per episode (critical alerts included): a 1,000-step NaN storm is a
  handful of log lines / webhook POSTs, with the count of the rest;
* the event log writes a bounded number of alarm records per step and per episode (the rest as
  ``alarms_coalesced`` counts that add up), and never waits for an ``fsync`` on the step path;
* metric names reach alert text inert (no forged lines, no ``<!channel>``);
* ``--events`` / event logs / state and control files never truncate or replace a file that is
  not one of ours, and never write through a planted symlink.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs import events as events_mod
from stability.outputs.alerts import LoggingSink, WebhookSink, format_alert, format_slack
from stability.outputs.events import AlarmStormBound, EventLog, read_events
from stability.outputs.safe_files import atomic_write, json_object
from stability.types import Alarm, Alert

NAN_ONLY = {"detectors": [{"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"],
                           "kind": "nonfinite"}]}


# ----------------------------------------------------------------------------- alert storms
def test_a_nan_storm_is_a_handful_of_critical_log_lines(caplog) -> None:
    sink = LoggingSink()
    mon = Monitor("default", alert_sinks=[sink], handler_timeout=None)
    with caplog.at_level(logging.INFO, "stability.alerts"):
        for s in range(300):
            mon.observe(s, {"loss": 2.0, "grad_norm": 1.0})
        for s in range(300, 1300):
            mon.observe(s, {"loss": math.nan, "grad_norm": math.inf})
        sink.close()
    crit = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    # the first response and the stop, decided once (was: 1,000 lines, one stop per step)
    assert len(crit) == 2 and mon.stopped_at == 301


def test_a_burst_of_critical_alerts_is_a_handful_of_log_lines(caplog) -> None:
    sink = LoggingSink()
    with caplog.at_level(logging.INFO, "stability.alerts"):
        for s in range(1000):
            sink.send(Alert(s, "nonfinite", severity="critical", message=f"loss NaN at {s}"))
        sink.close()
    crit = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(crit) == 3 and sink.stats["coalesced"] == 997
    assert "997 more alerts" in caplog.records[-1].getMessage()  # the rest, counted at close


class _Posts(WebhookSink):
    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9/unused", max_per_window=5, window_s=60.0)
        self.posted: list[tuple[Alert, int]] = []

    def _post(self, alert: Alert, suppressed: int) -> None:
        self.posted.append((alert, suppressed))


def test_critical_webhook_alerts_are_bounded_per_episode() -> None:
    sink = _Posts()
    for s in range(1000):
        sink.send(Alert(s, "nonfinite", severity="critical", message=f"loss NaN at {s}"))
    sink.send(Alert(5000, "nonfinite", severity="critical", message="a new episode"))
    assert sink.flush(10.0)
    sink.close(1.0)
    assert len(sink.posted) == 4  # 3 of the storm, the next episode's first
    assert sink.posted[-1][1] == 997  # carrying the count of the coalesced ones


def test_metric_names_reach_alert_text_inert() -> None:
    name = "loss\n[stability] CRITICAL step 1: forged <!channel>"
    a = Alert(1, "x", severity="critical", message=f"{name} is NaN")
    line = format_alert(a)
    assert "\n" not in line and "\\x0a" in line
    slack = format_slack(a, mention="<!here>")
    assert "<!channel>" not in json.dumps(slack) and "&lt;!channel&gt;" in slack["text"]
    assert slack["text"].startswith("<!here> ")  # the configured mention stays markup


# ----------------------------------------------------------------------------- event log storms
def _alarm(step: int, i: int) -> Alarm:
    return Alarm(step, "nonfinite", f"grad_norm/L{i}", 1.0, 0.5, "critical", "nonfinite",
                 f"grad_norm/L{i} is NaN")


def test_event_log_alarm_records_are_bounded_and_the_counts_add_up(tmp_path) -> None:
    path = tmp_path / "e.jsonl"
    log = EventLog(path, storm=AlarmStormBound(16, 200, 100))
    for s in range(300):
        for i in range(100):
            log.alarm(_alarm(s, i))
    log.close()
    recs = read_events(path)
    single = [r for r in recs if r["type"] == "alarm"]
    counted = [r for r in recs if r["type"] == "alarms_coalesced"]
    assert len(single) == 200 and len(recs) <= 200 + 300
    assert len(single) + sum(r["count"] for r in counted) == 300 * 100
    assert all(r["kinds"] == {"nonfinite": r["count"]} for r in counted)
    assert path.stat().st_size < 200_000


def test_critical_records_never_wait_for_the_disk(tmp_path, monkeypatch) -> None:
    real = os.fsync
    calls = []

    def slow(fd: int) -> None:
        calls.append(fd)
        time.sleep(0.2)
        real(fd)

    monkeypatch.setattr(events_mod.os, "fsync", slow)
    log = EventLog(tmp_path / "e.jsonl")
    t0 = time.monotonic()
    for s in range(50):
        log.append({"type": "rollback", "step": s})
    took = time.monotonic() - t0
    assert log.wait_synced(20.0)
    log.close()
    assert took < 1.0 < 50 * 0.2  # the appends did not wait for 50 fsyncs
    assert len(calls) < 50  # grouped


# ----------------------------------------------------------------------------- file safety
@pytest.mark.parametrize("content", [
    b"PK\x03\x04 a torch checkpoint" + bytes(range(256)),
    b'{"lr": 0.1, "layers": 12}',            # a JSON config without a final newline
    b"step,loss\n1,2.0\n2,2.1",              # the job's live metrics file, mid-write
])
def test_an_event_log_never_touches_a_file_that_is_not_one(tmp_path, content) -> None:
    p = tmp_path / "file"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="not a stability event log"):
        EventLog(p)
    assert p.read_bytes() == content


def test_replay_events_never_replaces_a_foreign_file(tmp_path, capsys) -> None:
    from replay.cli import main

    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in range(20)))
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"lr": 0.1}')
    assert main(["replay", str(run), "--events", str(cfg)]) == 2
    assert cfg.read_bytes() == b'{"lr": 0.1}'
    assert "not a file this tool wrote" in capsys.readouterr().err
    out = tmp_path / "events.jsonl"
    assert main(["replay", str(run), "--events", str(out)]) == 0
    assert main(["replay", str(run), "--events", str(out)]) == 0  # ours: replaced


def test_atomic_writes_never_follow_a_planted_symlink(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    state = tmp_path / "state.json"
    for name in (".state.json.tmp", f".state.json.{os.getpid()}.tmp", "state.json.tmp"):
        (tmp_path / name).symlink_to(victim)  # the old predictable names
    atomic_write(state, b'{"a": 1}', ours=json_object)
    assert victim.read_text() == "precious" and json.loads(state.read_text()) == {"a": 1}
    state.unlink()
    state.symlink_to(victim)  # a symlink at the destination is replaced, not followed
    atomic_write(state, b'{"a": 2}', ours=json_object)
    assert victim.read_text() == "precious" and not state.is_symlink()


def test_the_watch_control_file_never_replaces_a_foreign_file(tmp_path, caplog) -> None:
    from replay.watch import Watcher

    src = tmp_path / "m.jsonl"
    src.write_text("".join(json.dumps({"step": s, "loss": math.nan if s == 40 else 2.0})
                           + "\n" for s in range(60)))
    ctl = tmp_path / "train.py"
    ctl.write_text("print('the user code')\n")
    with pytest.raises(ValueError, match="not a file this tool wrote"):
        Watcher([str(src)], NAN_ONLY, control_file=str(ctl), echo=None)  # refused at start
    ok = tmp_path / "control.json"
    w = Watcher([str(src)], NAN_ONLY, control_file=str(ok), echo=None)
    ok.unlink(missing_ok=True)
    ok.write_text("print('put there while watching')\n")
    with caplog.at_level(logging.WARNING, "stability.watch"):
        w.run(once=True)  # ... and while watching: reported, the watcher goes on
    assert ok.read_text() == "print('put there while watching')\n"
    assert "cannot write the control file" in caplog.text and w.steps_judged == 60
    assert ctl.read_text() == "print('the user code')\n"
    assert not list(Path(tmp_path).glob("*.tmp")) and not list(Path(tmp_path).glob(".*.tmp"))
