"""Slow Prometheus clients are bounded: one server thread, a cap on clients, a deadline each
(issue 27, low: ``prometheus_client``'s server spent one thread of the training process per
client).  Real sockets on the loopback."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.scrape_server import MAX_REQUEST_BYTES, ScrapeServer


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _wait_until(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _scrape(port: int, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return bytes(r.read())


def test_slow_clients_add_no_threads_and_do_not_block_a_scrape() -> None:
    srv = ScrapeServer(lambda: b"up 1.0\n", port=0, max_clients=64, client_timeout=30.0)
    slow: list[socket.socket] = []
    try:
        before = threading.active_count()
        for _ in range(40):  # connect, send half a request line, then nothing
            s = _connect(srv.server_port)
            s.sendall(b"GET /metr")
            slow.append(s)
        assert _wait_until(lambda: srv.open_clients == 40)
        assert threading.active_count() == before  # not one thread per client
        t0 = time.monotonic()
        assert _scrape(srv.server_port) == b"up 1.0\n"  # served while 40 clients hang
        assert time.monotonic() - t0 < 5.0
    finally:
        for s in slow:
            s.close()
        srv.close()


def test_a_client_past_its_deadline_is_closed() -> None:
    srv = ScrapeServer(lambda: b"up 1.0\n", port=0, client_timeout=0.5)
    try:
        s = _connect(srv.server_port)
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finishes its head
        assert _wait_until(lambda: srv.open_clients == 1)
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # the server closed it
        assert time.monotonic() - t0 < 5.0
        assert srv.timed_out == 1 and srv.open_clients == 0
        s.close()
    finally:
        srv.close()


def test_a_client_that_never_reads_its_answer_is_closed_at_its_deadline() -> None:
    big = b"x" * (32 << 20)  # more than the socket buffers hold
    srv = ScrapeServer(lambda: big, port=0, client_timeout=0.5)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.server_port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # then does not read
        assert _wait_until(lambda: srv.timed_out == 1)
        assert srv.open_clients == 0
        assert _scrape(srv.server_port, timeout=30) == big  # the next scraper is served
        s.close()
    finally:
        srv.close()


def test_idle_clients_at_the_cap_cannot_keep_a_scraper_out() -> None:
    """More idle clients than slots: each new connection replaces the oldest idle one, so a
    scraper is served at once (no wait for the idle clients' deadlines)."""
    srv = ScrapeServer(lambda: b"up 1.0\n", port=0, max_clients=2, client_timeout=30.0)
    held = [_connect(srv.server_port) for _ in range(5)]
    try:
        # the server thread counts an eviction before it registers the newcomer: wait for both
        assert _wait_until(lambda: srv.evicted == 3 and srv.open_clients == 2)
        t0 = time.monotonic()
        assert _scrape(srv.server_port) == b"up 1.0\n"
        assert time.monotonic() - t0 < 5.0 and srv.refused == 0
        held[0].settimeout(5)
        assert held[0].recv(16) == b""  # the oldest idle one was closed
    finally:
        for s in held:
            s.close()
        srv.close()


def test_clients_beyond_the_cap_are_refused_when_every_slot_is_answering() -> None:
    big = b"x" * (32 << 20)  # more than the socket buffers hold: its answer stays pending
    srv = ScrapeServer(lambda: big, port=0, max_clients=1, client_timeout=30.0)
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", srv.server_port))
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # then does not read
        assert _wait_until(lambda: srv.served == 1)
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(srv.server_port)
        assert e.value.code == 503  # answered at once, not queued behind the slow reader
        assert srv.refused == 1 and srv.open_clients == 1
    finally:
        s.close()
        srv.close()


def test_bad_requests_get_an_answer_not_a_crash() -> None:
    def boom() -> bytes:
        raise RuntimeError("collector failed")

    srv = ScrapeServer(boom, port=0)
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(srv.server_port)
        assert e.value.code == 500
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.server_port}/nope", timeout=5)
        assert e.value.code == 404
        s = _connect(srv.server_port)
        s.sendall(b"GET /" + b"a" * (MAX_REQUEST_BYTES + 10))
        assert s.recv(64).startswith(b"HTTP/1.1 431")
        s.close()
        srv.body = lambda: b"ok\n"  # the loop survived all of the above
        assert _scrape(srv.server_port) == b"ok\n"
    finally:
        srv.close()


def test_close_ends_the_thread_and_frees_the_port() -> None:
    srv = ScrapeServer(lambda: b"up 1.0\n", port=0)
    held = _connect(srv.server_port)
    port = srv.server_port
    srv.close()
    assert not srv._thread.is_alive()
    held.settimeout(5)
    assert held.recv(64) == b""  # open clients are closed with the server
    held.close()
    with pytest.raises(OSError):
        _connect(port).recv(1)


def test_the_exporter_serves_through_the_bounded_server() -> None:
    pytest.importorskip("prometheus_client")
    from stability.outputs.prometheus import PrometheusExporter

    mon = Monitor("default", alert_sinks=[])
    exp = PrometheusExporter(mon, port=0, max_clients=3, client_timeout=30.0)
    held = [_connect(exp.port) for _ in range(10)]  # type: ignore[arg-type]
    try:
        assert isinstance(exp.server, ScrapeServer)
        assert _wait_until(lambda: exp.server is not None and exp.server.evicted == 7)
        exp.update(mon.observe(0, {"loss": 2.0}))
        assert b"stability_last_step 0.0" in _scrape(exp.port)  # type: ignore[arg-type]
    finally:
        for s in held:
            s.close()
        exp.close()
