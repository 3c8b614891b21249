"""Lows of issue 27 (item 9): what the project exposes and how it reads.

* the Prometheus endpoint binds the loopback interface unless told otherwise;
* a webhook answering with a redirect is a failed delivery, never followed to another host;
* one TensorBoard record with a bad payload CRC costs the watcher that record only.
"""

from __future__ import annotations

import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.alerts import WebhookSink
from stability.types import Alert


def test_prometheus_binds_the_loopback_by_default() -> None:
    pytest.importorskip("prometheus_client")
    from stability.outputs.prometheus import PrometheusExporter

    exp = PrometheusExporter(Monitor("default", alert_sinks=[]), port=0)
    try:
        assert exp.server.server_address[0] == "127.0.0.1"
    finally:
        exp.server.shutdown()
        exp.server.server_close()


def test_the_watch_cli_has_a_prometheus_address_option() -> None:
    from replay.cli import build_parser

    a = build_parser().parse_args(["watch", "x.jsonl", "--prometheus-port", "0"])
    assert a.prometheus_addr == "127.0.0.1"
    a = build_parser().parse_args(["watch", "x.jsonl", "--prometheus-addr", "0.0.0.0"])
    assert a.prometheus_addr == "0.0.0.0"


def test_a_webhook_redirect_is_a_failed_delivery() -> None:
    gets: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/elsewhere")
            self.end_headers()

        def do_GET(self) -> None:
            gets.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        sink = WebhookSink(f"http://127.0.0.1:{srv.server_port}/hook", timeout=5.0)
        sink.send(Alert(1, "x", severity="critical", message="NaN"))
        assert sink.flush(10.0)
        sink.close(1.0)
    finally:
        srv.shutdown()
        srv.server_close()
    assert gets == [] and sink.stats["failed"] == 1 and sink.stats["sent"] == 0


def test_one_bad_tensorboard_record_costs_only_itself(tmp_path) -> None:
    from replay.importers.tensorboard import write_scalar_events
    from replay.watch import Watcher

    path = tmp_path / "events.out.tfevents.1.host"
    write_scalar_events(str(path), [(s, {"loss": 2.0 + s}) for s in range(10)])
    data = bytearray(path.read_bytes())
    pos, records = 0, []
    while pos < len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        records.append((pos, n))
        pos += 12 + n + 4
    start, n = records[4]  # (record 0 is the file_version event)
    data[start + 12 + n - 1] ^= 0xFF  # the payload's last byte: its CRC no longer matches
    path.write_bytes(bytes(data))
    w = Watcher([str(tmp_path)], "default", echo=None, format="tensorboard")
    w.run(once=True)
    assert w.steps_judged == 9
