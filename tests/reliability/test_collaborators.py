"""Faulty collaborators: handlers, alert sinks, webhooks, disks and checkpoint functions that fail.

In every case training goes on (``observe()`` / ``log()`` / ``guard.step()`` return), the failure
is reported once (one log record, not one per step) and nothing already recorded is lost.

Read-only directories: the suite may run as root, where ``chmod`` does not stop writes, so a
"read-only" location is a path *under a regular file* (``NotADirectoryError`` on every write) and a
full disk is ``/dev/full`` (``ENOSPC``) or a patched writer failing with ``ENOSPC``.
"""

from __future__ import annotations

import errno
import http.server
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.alerts import AlertRouter, WebhookSink
from stability.outputs.events import EventLog, read_events
from stability.types import Alert

CONFIG = {"detectors": [{"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"],
                         "kind": "nonfinite"}]}
LIVENESS_S = 20.0  # generous bound for "returns at all" (not a timing assertion)


def _errors(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def _run_bounded(fn: Any, timeout: float = LIVENESS_S) -> Any:
    """Run ``fn()`` in a daemon thread; fail (instead of hanging the suite) past ``timeout``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"call still running after {timeout} s (hang)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _feed_nan(mon: Monitor, n: int, start: int = 0) -> list[Any]:
    return [mon.observe(start + s, {"loss": math.nan, "grad_norm": 1.0}) for s in range(n)]


# ---------------------------------------------------------------------------- handlers
def test_raising_handler_is_contained_and_reported_once(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    calls = []

    def broken(item: Any) -> None:
        calls.append(item)
        raise RuntimeError("user bug")

    mon = Monitor(CONFIG, on_alarm=broken, on_intervention=broken)
    with caplog.at_level(logging.WARNING):
        decisions = _feed_nan(mon, 50)
    assert all(d.alarms for d in decisions)
    assert len(calls) >= 50 and mon.handlers.n_errors == len(calls)
    assert len(_errors(caplog, "stability.handlers")) == 1  # one per handler function


def test_slow_handler_does_not_change_decisions() -> None:
    def slow(item: Any) -> None:
        time.sleep(0.01)

    a, b = Monitor(CONFIG, on_alarm=slow), Monitor(CONFIG)
    da, db = _feed_nan(a, 10), _feed_nan(b, 10)
    assert [d.alarms for d in da] == [d.alarms for d in db]


def test_hanging_handler_is_abandoned_with_a_timeout(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    def hang(item: Any) -> None:
        release.wait(30)

    mon = Monitor(CONFIG, on_alarm=hang, handler_timeout=0.05)
    try:
        with caplog.at_level(logging.WARNING):
            _run_bounded(lambda: _feed_nan(mon, 5))
        # one hang (reported once); its later calls are dropped, not made again
        assert mon.handlers.n_errors == 1
        assert mon.handlers.dropped[hang.__qualname__] == 4
        assert mon.handlers.hung == [hang.__qualname__]
        about_hang = [r for r in _errors(caplog, "stability.handlers")
                      if hang.__qualname__ in r.getMessage()]
        assert len(about_hang) == 1
    finally:
        release.set()


def test_hanging_handler_with_default_monitor_settings() -> None:
    release = threading.Event()
    mon = Monitor(CONFIG, on_alarm=lambda a: release.wait(30))
    try:
        _run_bounded(lambda: _feed_nan(mon, 3), timeout=5.0)
    finally:
        release.set()


# ---------------------------------------------------------------------------- alert sinks
class _RaisingSink:
    def __init__(self) -> None:
        self.calls = 0

    def send(self, alert: Alert) -> None:
        self.calls += 1
        raise ConnectionError("sink down")


def test_raising_user_sink_is_contained() -> None:
    sink = _RaisingSink()
    mon = Monitor(CONFIG, alert_sinks=[sink])
    _feed_nan(mon, 30)
    assert sink.calls >= 1


def test_raising_user_sink_behind_a_router_is_contained(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    sink = _RaisingSink()
    mon = Monitor(CONFIG, alert_sinks=AlertRouter([sink]))  # type: ignore[list-item]
    with caplog.at_level(logging.WARNING):
        _feed_nan(mon, 30)
    assert sink.calls >= 1


# ---------------------------------------------------------------------------- webhook
class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "500"
    hits = 0

    def do_POST(self) -> None:  # http.server API
        type(self).hits += 1
        n = int(self.headers.get("Content-Length", 0))
        self.rfile.read(n)
        if self.mode == "hang":
            time.sleep(3.0)
            return
        self.send_response(500)
        self.end_headers()
        self.wfile.write(b"boom")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_server(request: pytest.FixtureRequest) -> Iterator[str]:
    handler = type("H", (_Handler,), {"mode": request.param, "hits": 0})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/hook"
    finally:
        srv.shutdown()
        srv.server_close()


def _refused_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return f"http://127.0.0.1:{port}/hook"


def _exercise_webhook(url: str, caplog: pytest.LogCaptureFixture) -> WebhookSink:
    sink = WebhookSink(url, timeout=0.3, max_per_window=3, window_s=60.0, max_queue=10)
    mon = Monitor(CONFIG, alert_sinks=[sink])
    with caplog.at_level(logging.WARNING):
        decisions = _run_bounded(lambda: _feed_nan(mon, 200))
        for i in range(100):  # and direct sends, critical and not
            sink.send(Alert(i, "r", severity="critical" if i % 3 else "warning", message="x"))
        _run_bounded(lambda: sink.close(timeout=1.0))
    assert len(decisions) == 200
    assert sink.stats["failed"] >= 1
    assert len(_errors(caplog, "stability.alerts")) == 1, "reported more than once"
    return sink


def test_webhook_connection_refused(caplog: pytest.LogCaptureFixture) -> None:
    _exercise_webhook(_refused_url(), caplog)


@pytest.mark.parametrize("http_server", ["500", "hang"], indirect=True)
def test_webhook_error_or_silent_server(http_server: str, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    _exercise_webhook(http_server, caplog)


# ---------------------------------------------------------------------------- disks
def _blocked_dir(tmp_path: Path) -> Path:
    """A directory path nobody can write under, even root: its parent is a regular file."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    return f / "sub"


def test_event_log_on_unwritable_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        log = EventLog(_blocked_dir(tmp_path) / "events.jsonl")
        mon = Monitor(CONFIG, event_log=log)
        _feed_nan(mon, 20)
    assert log.n_written == 0 and log.n_dropped >= 20
    assert len(_errors(caplog, "stability.events")) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_event_log_on_full_disk(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        log = EventLog("/dev/full", fsync="never")
        mon = Monitor(CONFIG, event_log=log)
        _feed_nan(mon, 20)
    assert log.n_dropped >= 20
    assert len(_errors(caplog, "stability.events")) == 1


def test_event_log_disk_fills_up_mid_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    import stability.outputs.events as events_mod

    path = tmp_path / "events.jsonl"
    log = EventLog(path, fsync="never")
    mon = Monitor(CONFIG, event_log=log)
    _feed_nan(mon, 10)
    kept = read_events(path)
    real_write = os.write
    state = {"full": True}

    def full_write(fd: int, data: Any) -> int:
        if fd == log._fd and state["full"]:
            real_write(fd, bytes(data)[:7])  # a short write, then the disk is full
            state["full"] = False  # the next call fails outright
            return 7
        if fd == log._fd and not state.get("recovered"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(events_mod.os, "write", full_write)
    with caplog.at_level(logging.WARNING):
        _feed_nan(mon, 10, start=10)
    state["recovered"] = True
    _feed_nan(mon, 10, start=20)
    log.close()
    got = read_events(path, errors="raise")  # no corrupt line in the middle
    assert got[: len(kept)] == kept  # nothing already recorded was lost
    assert [e["step"] for e in got[len(kept):]][:1] == [20]
    assert len(_errors(caplog, "stability.events")) == 1


def test_event_log_repairs_a_torn_tail_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.info(1, "a")
    with open(path, "ab") as f:
        f.write(b'{"type":"info","st')  # crash mid-write
    assert [e["step"] for e in read_events(path)] == [1]  # torn last line skipped
    with EventLog(path) as log:
        log.info(2, "b")
    assert [e["step"] for e in read_events(path, errors="raise")] == [1, 2]


def test_recorder_directory_under_a_file_fails_clearly(tmp_path: Path) -> None:
    from replay.recorder import RunRecorder

    bad = _blocked_dir(tmp_path)
    with pytest.raises(OSError) as exc:
        RunRecorder(bad)
    assert "not-a-dir" in str(exc.value)


def test_recorder_survives_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    import replay.recorder as recorder_mod
    from replay.reader import read_run

    rec = recorder_mod.RunRecorder(tmp_path / "run", part_steps=4)
    for s in range(8):
        rec.log(s, {"loss": float(s)})
    real = recorder_mod.pq.write_table
    full = {"on": True}

    def write(table: Any, where: Any, **kw: Any) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(table, where, **kw)

    monkeypatch.setattr(recorder_mod.pq, "write_table", write)
    with caplog.at_level(logging.WARNING):
        for s in range(8, 40):
            rec.log(s, {"loss": float(s)})  # must not raise
    full["on"] = False
    for s in range(40, 44):
        rec.log(s, {"loss": float(s)})
    rec.close()
    steps = read_run(tmp_path / "run").column("step").to_pylist()
    assert steps[:8] == list(range(8))  # what was on disk is still there
    assert steps == list(range(44))  # and the rows buffered while the disk was full are kept
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


# ---------------------------------------------------------------------------- checkpoints
torch = pytest.importorskip("torch")


def _guard(tmp_path: Path, monitor: Monitor) -> Any:
    from stability.adapters.torch import TorchGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, TorchGuard(model, opt, None, monitor, checkpoint_dir=tmp_path / "ckpt",
                                  checkpoint_every=5)


def test_failing_emergency_checkpoint_does_not_stop_training(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    mon = Monitor(CONFIG)
    model, opt, guard = _guard(tmp_path, mon)
    real_save = guard.store.save

    def save(*args: Any, **kw: Any) -> Any:
        if not kw.get("healthy", True):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kw)

    monkeypatch.setattr(guard.store, "save", save)
    x = torch.ones(8, 4)
    with caplog.at_level(logging.WARNING):
        for i in range(30):
            loss = model(x).pow(2).mean()
            loss.backward()
            bad = i in (10, 11, 12, 20)
            guard.step(torch.tensor(math.nan) if bad else loss)
    # every step ran (the policy's rollback rewinds the step count by the steps it lost)
    assert guard.step_count + guard.steps_lost >= 30
    assert guard.checkpoint_failures >= 1
    # the failure is logged once by the adapter (alert lines naming the action are separate)
    assert len([r for r in caplog.records if r.name == "stability.adapters"
                and "checkpoint" in r.getMessage().lower() and "failed" in r.getMessage()]) == 1


def test_checkpoint_flushes_the_recorder_and_failures_reach_the_event_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from replay.reader import read_run
    from replay.recorder import RunRecorder
    from stability.adapters.torch import TorchGuard

    events = EventLog(tmp_path / "events.jsonl")
    mon = Monitor(CONFIG, event_log=events)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = RunRecorder(tmp_path / "run", part_steps=1000)
    guard = TorchGuard(model, opt, None, mon, checkpoint_dir=tmp_path / "ckpt",
                       checkpoint_every=5, recorder=rec)
    real_save = guard.store.save

    def save(*args: Any, **kw: Any) -> Any:
        if not kw.get("healthy", True):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kw)

    monkeypatch.setattr(guard.store, "save", save)
    x = torch.ones(8, 4)
    for _ in range(9):
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
    # the periodic checkpoint of step 5 flushed every row logged up to it (before close())
    assert read_run(tmp_path / "run").column("step").to_pylist() == list(range(6))
    for i in range(9, 16):
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(torch.tensor(math.nan) if i in (10, 11, 12) else loss)
    rec.close()
    events.close()
    failed = [e for e in read_events(tmp_path / "events.jsonl") if e["type"] == "checkpoint_failed"]
    assert failed and "No space left" in failed[0]["error"]
    assert guard.checkpoint_failures == len(failed)
