"""Tests of the alert sinks (stability/outputs/alerts.py) against a local HTTP server on
127.0.0.1."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stability.outputs.alerts import (
    AlertRouter,
    AlertSink,
    FileSink,
    LoggingSink,
    RateLimiter,
    WebhookSink,
    format_alert,
    make_sink,
)
from stability.types import Alert


class _Server:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/hang":
                    outer.release.wait(10)
                    return
                if self.path == "/500":
                    self.send_response(500)
                    self.end_headers()
                    return
                outer.bodies.append({"ctype": self.headers["Content-Type"],
                                     **json.loads(body)})
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def _shared_server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


@pytest.fixture
def server(_shared_server: _Server) -> _Server:
    _shared_server.bodies.clear()
    return _shared_server


def _refused_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/"


def warn(step: int, msg: str = "loss spike") -> Alert:
    return Alert(step, "L1", severity="warning", message=msg)


def crit(step: int, msg: str = "rollback") -> Alert:
    return Alert(step, "L3", severity="critical", message=msg)


def test_webhook_posts_slack_json(server: _Server) -> None:
    sink = WebhookSink(server.url + "/ok", timeout=2.0)
    sink.send(warn(10, "loss 9 sigma"))
    assert sink.flush(5.0)
    sink.close(1.0)
    assert server.bodies == [{"ctype": "application/json",
                              "text": "[stability] WARNING step 10: loss 9 sigma"}]
    assert sink.stats["sent"] == 1 and sink.stats["failed"] == 0


def test_rate_limit_coalesces_warnings_and_critical_always_goes(server: _Server) -> None:
    sink = WebhookSink(server.url + "/ok", max_per_window=2, window_s=3600.0)
    for s in range(5):
        sink.send(warn(s))
    sink.send(crit(5))
    sink.send(crit(6))
    assert sink.flush(5.0)
    sink.close(1.0)
    texts = sorted(b["text"] for b in server.bodies)   # criticals may overtake warnings
    assert len(texts) == 4 and sink.stats["coalesced"] == 3
    assert "CRITICAL step 5" in texts[0] and "+3 more alerts suppressed" in texts[0]
    assert "CRITICAL step 6" in texts[1] and "suppressed" not in texts[1]
    assert "WARNING step 0" in texts[2] and "WARNING step 1" in texts[3]


def test_suppressed_count_is_sent_on_close(server: _Server) -> None:
    sink = WebhookSink(server.url + "/ok", max_per_window=1, window_s=3600.0)
    sink.send(warn(1))
    sink.send(warn(2))
    sink.close(5.0)
    assert len(server.bodies) == 2 and "+1 more" in server.bodies[1]["text"]


@pytest.mark.parametrize("where", ["500", "refused"])
def test_failing_endpoint_reported_once(server: _Server, where: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    url = server.url + "/500" if where == "500" else _refused_url()
    with caplog.at_level(logging.WARNING, logger="stability.alerts"):
        sink = WebhookSink(url, timeout=2.0, max_per_window=100)
        for s in range(3):
            sink.send(crit(s))
        assert sink.flush(10.0)
        sink.close(1.0)
    assert sink.stats["failed"] == 3 and sink.stats["sent"] == 0
    assert sum("failed" in r.message for r in caplog.records) == 1


def test_hanging_endpoint_never_blocks_and_queue_is_bounded(server: _Server) -> None:
    sink = WebhookSink(server.url + "/hang", timeout=0.3, max_queue=2, max_per_window=100)
    for s in range(10):           # returns at once although the endpoint never answers
        sink.send(warn(s))
    sink.send(crit(10))           # replaces a queued warning instead of being dropped
    assert sink.stats["dropped"] >= 7
    assert sink.flush(10.0)       # each request times out after 0.3 s
    sink.close(1.0)
    assert sink.stats["failed"] >= 2 and sink.stats["sent"] == 0
    sink.send(warn(11))           # after close: dropped, no error
    assert not sink._thread.is_alive()


def test_close_is_bounded_with_a_hanging_endpoint(server: _Server) -> None:
    sink = WebhookSink(server.url + "/hang", timeout=5.0, max_per_window=100)
    for s in range(3):
        sink.send(crit(s))
    sink.close(0.2)               # gives up on the queue instead of waiting 15 s
    assert sink.stats["dropped"] >= 1


def test_logging_and_file_sinks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="stability.alerts"):
        LoggingSink().send(crit(3, "stop"))
    assert caplog.records[-1].levelno == logging.CRITICAL
    assert "CRITICAL step 3: stop" in caplog.text
    f = FileSink(tmp_path / "alerts.txt")
    f.send(warn(1))
    f.send(crit(2))
    lines = (tmp_path / "alerts.txt").read_text().splitlines()
    assert len(lines) == 2 and lines[1].endswith(format_alert(crit(2)))


def test_broken_sinks_are_contained(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Boom(AlertSink):
        def send(self, alert: Alert) -> None:
            raise RuntimeError("user sink bug")

    good = FileSink(tmp_path / "a.txt")
    bad_file = FileSink(tmp_path / "missing-dir" / "a.txt")
    router = AlertRouter([Boom(), bad_file, good])
    with caplog.at_level(logging.WARNING, logger="stability.alerts"):
        for s in range(3):
            router.send(warn(s))
    router.close()
    assert len((tmp_path / "a.txt").read_text().splitlines()) == 3
    assert bad_file.stats["failed"] == 3
    assert sum("sink file failed" in r.message for r in caplog.records) == 1


def test_rate_limiter_and_factory() -> None:
    t = [0.0]
    rl = RateLimiter(1, 5.0, clock=lambda: t[0])
    assert rl.allow() and not rl.allow() and rl.allow(force=True)
    t[0] = 5.0
    assert rl.allow()
    with pytest.raises(ValueError):
        RateLimiter(0, 1.0)
    with pytest.raises(ValueError, match="http"):
        WebhookSink("ftp://x")
    with pytest.raises(ValueError, match="Unknown alert sink"):
        make_sink({"type": "pager"})
    assert isinstance(make_sink({}), LoggingSink)
