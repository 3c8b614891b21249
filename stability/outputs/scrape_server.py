"""A bounded HTTP server for Prometheus scrapes: one thread, however many clients connect.

``prometheus_client.start_http_server`` serves every connection in a thread of its own, so a
client that connects and then sends nothing (or reads its answer one byte a minute) holds a thread
of the *training process* for as long as it likes: N slow clients, N threads.  This server runs
one selector loop in one daemon thread instead:

* every socket is non-blocking; the loop reads requests and writes answers as the sockets allow,
  so a slow client costs a few bytes of buffer, never a thread and never a wait;
* every client has a *deadline* (``client_timeout`` seconds from its connection to the last byte
  of its answer); a client still connected at its deadline is closed;
* at most ``max_clients`` connections are open at once.  When they are all taken, a new one
  takes the place of the oldest connection that has not finished sending its request (a client
  that connects and idles cannot keep a scraper out); when every slot is busy answering, the new
  one is answered ``503`` (best effort, without waiting) and closed;
* a request is read up to ``MAX_REQUEST_BYTES``; a longer head is answered ``431`` and closed.

The body of ``GET /metrics`` (or ``/``) is produced by a callable (the exporter passes
``prometheus_client.generate_latest(registry)``) in the loop's thread, once per request.
``HEAD`` gets the headers only; any other method ``405``, any other path ``404``.

Examples
--------
>>> import urllib.request
>>> srv = ScrapeServer(lambda: b"up 1.0\\n", port=0)
>>> with urllib.request.urlopen(f"http://127.0.0.1:{srv.server_port}/metrics") as r:
...     r.read()
b'up 1.0\\n'
>>> srv.close()
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["MAX_REQUEST_BYTES", "ScrapeServer"]

log = logging.getLogger("stability.outputs")

#: The longest request head (request line + headers) the server reads.
MAX_REQUEST_BYTES = 8192
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass
class _Client:
    """One open connection: what it sent so far, what is left to send, when it must be done."""

    sock: socket.socket
    deadline: float
    request: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None


def _response(status: int, body: bytes, *, head_only: bool = False) -> bytes:
    """A complete HTTP/1.1 answer that closes the connection."""
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode("ascii")
    return head if head_only else head + body


class ScrapeServer:
    """Serve ``body()`` at ``/metrics`` from one selector thread with per-client deadlines.

    Parameters
    ----------
    body
        Called once per ``GET``/``HEAD`` of ``/metrics`` (or ``/``); returns the answer's bytes.
        An exception is answered ``500`` (and logged), never raised into the loop.
    port
        Port to bind (``0``: any free port, see :attr:`server_port`).
    addr
        Address to bind (default ``"127.0.0.1"``: this machine only).
    max_clients
        Connections open at once (default 16); beyond it a new connection replaces the oldest
        one still sending its request, or is answered ``503`` and closed.
    client_timeout
        Seconds a connection may stay open, request and answer together (default 5).
    clock
        Monotonic time source (default :func:`time.monotonic`).
    """

    def __init__(self, body: Callable[[], bytes], port: int = 0, addr: str = "127.0.0.1", *,
                 max_clients: int = 16, client_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(max_clients, int) and max_clients >= 1):
            raise ValueError(f"The 'max_clients' parameter of ScrapeServer must be an int in "
                             f"the range [1, inf). Got {max_clients!r} instead.")
        if not client_timeout > 0:
            raise ValueError(f"The 'client_timeout' parameter of ScrapeServer must be a float "
                             f"in the range (0, inf). Got {client_timeout!r} instead.")
        self.body = body
        self.max_clients = max_clients
        self.client_timeout = float(client_timeout)
        self.clock = clock
        self.served = 0
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0
        self._clients: dict[int, _Client] = {}
        self._closing = False
        self._listener = socket.create_server((addr, port), family=_family(addr), backlog=64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="stability-prometheus",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the socket server API
    @property
    def server_address(self) -> tuple[str, int]:
        """``(host, port)`` the server is bound to."""
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def server_port(self) -> int:
        """The bound port (the free port chosen when created with ``port=0``)."""
        return self.server_address[1]

    @property
    def open_clients(self) -> int:
        """Connections open now."""
        return len(self._clients)

    def shutdown(self) -> None:
        """Stop the loop and wait for its thread (idempotent); open connections are closed."""
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    def server_close(self) -> None:
        """Close the listening socket (after :meth:`shutdown`)."""
        self.shutdown()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def close(self) -> None:
        """:meth:`shutdown` and :meth:`server_close`."""
        self.server_close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            while not self._closing:
                for key, events in self._sel.select(timeout=self._next_timeout()):
                    self._dispatch(key, events)
                self._expire(self.clock())
        except Exception:  # the exporter must never take the training process down
            log.exception("Prometheus scrape server stopped")
        finally:
            for fd in list(self._clients):
                self._drop(fd)
            self._sel.close()

    def _next_timeout(self) -> float | None:
        """Seconds until the earliest client deadline (``None``: no client, wait for one)."""
        if not self._clients:
            return None
        return max(0.0, min(c.deadline for c in self._clients.values()) - self.clock())

    def _dispatch(self, key: selectors.SelectorKey, events: int) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            self._wake_r.recv(64)
        elif events & selectors.EVENT_READ:
            self._read(key.fd)
        elif events & selectors.EVENT_WRITE:
            self._write(key.fd)

    def _accept(self) -> None:
        """Take every pending connection; those beyond ``max_clients`` are refused."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.debug("accept failed", exc_info=True)
                return
            sock.setblocking(False)
            if len(self._clients) >= self.max_clients and not self._evict_idlest():
                self._refuse(sock)
                continue
            self._clients[sock.fileno()] = _Client(sock, self.clock() + self.client_timeout)
            self._sel.register(sock, selectors.EVENT_READ, "client")

    def _evict_idlest(self) -> bool:
        """Close the oldest connection still sending its request; ``False`` when every open
        connection is being answered."""
        reading = [(c.deadline, fd) for fd, c in self._clients.items() if c.answer is None]
        if not reading:
            return False
        self.evicted += 1
        self._drop(min(reading)[1])
        return True

    def _refuse(self, sock: socket.socket) -> None:
        """One non-blocking ``503`` attempt, then close: a full server never waits."""
        self.refused += 1
        try:
            sock.send(_response(503, b"too many clients\n"))
        except OSError:
            pass
        sock.close()

    def _read(self, fd: int) -> None:
        c = self._clients[fd]
        try:
            chunk = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(fd)  # the client went away before its request was complete
            return
        c.request += chunk
        if b"\r\n\r\n" in c.request or b"\n\n" in c.request:
            self._answer(fd, self._route(bytes(c.request)))
        elif len(c.request) > MAX_REQUEST_BYTES:
            self._answer(fd, _response(431, b"request too large\n"))

    def _route(self, request: bytes) -> bytes:
        """The answer to one request head."""
        line = request.split(b"\n", 1)[0].decode("latin-1").strip().split()
        method, target = (line + ["", ""])[:2]
        if method not in ("GET", "HEAD"):
            return _response(405, b"method not allowed\n")
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return _response(404, b"not found\n")
        try:
            body = self.body()
        except Exception:
            log.exception("Prometheus scrape failed")
            return _response(500, b"scrape failed\n")
        self.served += 1
        return _response(200, body, head_only=method == "HEAD")

    def _answer(self, fd: int, data: bytes) -> None:
        c = self._clients[fd]
        c.answer = memoryview(data)
        self._sel.modify(c.sock, selectors.EVENT_WRITE, "client")
        self._write(fd)

    def _write(self, fd: int) -> None:
        c = self._clients[fd]
        if c.answer is None:
            return
        try:
            sent = c.sock.send(c.answer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(fd)
            return
        c.answer = c.answer[sent:]
        if not c.answer:
            self._drop(fd)

    def _expire(self, now: float) -> None:
        """Close every connection past its deadline."""
        for fd in [fd for fd, c in self._clients.items() if c.deadline <= now]:
            self.timed_out += 1
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        c = self._clients.pop(fd, None)
        if c is None:
            return
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET
