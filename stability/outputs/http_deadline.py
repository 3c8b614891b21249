"""HTTP(S) requests with one total wall-clock deadline, for the webhook alert sink.

A per-operation socket timeout never fires against a server that trickles one byte just before
it would; :func:`deadline_opener` gives every connect, send and receive of a request only the
time left before one fixed deadline (:mod:`stability.outputs.alerts`' ``WebhookSink`` uses it).
"""

from __future__ import annotations

import http.client
import io
import socket
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["deadline_opener"]


class _DeadlineSocket:
    """Socket proxy: each send / receive may only use the time left before ``deadline``.

    A per-operation socket timeout never fires against a server that sends one byte just
    before it would; re-arming the timeout to the time left before one fixed deadline does.
    """

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("webhook request exceeded its total deadline")
        self._sock.settimeout(left)

    def recv_into(self, buf: Any, *args: Any) -> int:
        self._arm()
        n: int = self._sock.recv_into(buf, *args)
        return n

    def recv(self, *args: Any) -> bytes:
        self._arm()
        data: bytes = self._sock.recv(*args)
        return data

    def sendall(self, data: Any, *args: Any) -> None:
        self._arm()
        self._sock.sendall(data, *args)

    def makefile(self, mode: str = "r", buffering: int | None = None, **_: Any) -> Any:
        if "b" not in mode or "w" in mode:  # http.client reads responses with makefile("rb")
            raise ValueError(f"_DeadlineSocket.makefile supports 'rb' only, not {mode!r}")
        raw = socket.SocketIO(self, "rb")  # type: ignore[arg-type]
        self._sock._io_refs += 1
        return io.BufferedReader(raw, buffering or io.DEFAULT_BUFFER_SIZE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _DeadlineHTTPConnection(http.client.HTTPConnection):
    deadline = 0.0

    def connect(self) -> None:
        self.timeout = max(self.deadline - time.monotonic(), 1e-3)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTPSConnection(http.client.HTTPSConnection):
    deadline = 0.0

    def connect(self) -> None:
        self.timeout = max(self.deadline - time.monotonic(), 1e-3)
        super().connect()  # TCP connect and TLS handshake, each with the time left
        self.sock = _DeadlineSocket(self.sock, self.deadline)


def deadline_opener(deadline: float) -> urllib.request.OpenerDirector:
    """A urllib opener whose HTTP(S) requests must finish by ``deadline`` (``time.monotonic``).

    Proxies and redirects work as with :func:`urllib.request.urlopen`; name resolution is not
    covered by the deadline (the system resolver has no timeout).
    """

    def http_conn(host: str, /, **kw: Any) -> http.client.HTTPConnection:
        c = _DeadlineHTTPConnection(host, **kw)
        c.deadline = deadline
        return c

    def https_conn(host: str, /, **kw: Any) -> http.client.HTTPConnection:
        c = _DeadlineHTTPSConnection(host, **kw)
        c.deadline = deadline
        return c

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(http_conn, req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            ctx = getattr(self, "_context", None)
            return self.do_open(https_conn, req, context=ctx)

    return urllib.request.build_opener(Http, Https, _NoRedirect)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: a webhook answering 3xx is a failed delivery (following it
    would send the alert to another host, as a GET, and count it as sent)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl[:200]} not "
                                     "followed (webhooks are POSTed to the configured URL only)",
                                     headers, fp)
