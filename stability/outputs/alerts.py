"""Alert sinks: Python logging (default), a file, and a Slack-compatible HTTP webhook.

A sink's :meth:`~AlertSink.send` never raises and never blocks the training loop: the webhook
posts from a background thread through a bounded queue, with a wall-clock deadline per request
(connect, send, status line and headers together: a server that trickles bytes cannot hold a
request past ``timeout``, see :mod:`stability.outputs.http_deadline`), rate limiting (at most
``max_per_window`` warnings per ``window_s`` seconds; the rest are coalesced into a count that
rides on the next message) and escalation (critical alerts go ahead of warnings).
Failures are reported once through :mod:`logging` and counted in ``stats``.

Storms stay bounded in every sink (:class:`EpisodeGate`): alerts of one severity whose steps
lie within ``gap_steps`` of each other form an episode; the first ``max_per_episode`` of an
episode go out, the rest are coalesced into a count that rides on the next alert that goes (a
reminder every ``remind_s`` seconds while the episode lasts, the next episode, or close).  A
1,000-step NaN storm is a handful of messages, not 1,000.

Text from the run (metric names, messages) is made inert on the way out: control characters are
escaped (a newline in a metric name cannot forge a line in the log or the file sink) and, in
webhook payloads, ``&``, ``<`` and ``>`` are escaped (a metric named ``<!channel>`` cannot ping
anyone).

From configuration data: :func:`sinks_from_config` builds the sinks of an ``[alerts]`` table
(the logging sink is on by default) and :func:`event_log_from_config` the
:class:`~stability.outputs.events.EventLog` of an ``[event_log]`` table (see
:mod:`stability.config.config`).

Examples
--------
>>> from stability.types import Alert
>>> sink = LoggingSink()
>>> sink.send(Alert(5, "L1: loss_spike(loss)", severity="warning", message="loss spiked"))
>>> sink.stats["sent"]
1
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from stability.outputs.http_deadline import deadline_opener
from stability.types import Alert

logger = logging.getLogger("stability.alerts")

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.CRITICAL}
_ORDER = ("info", "warning", "critical")


def _rank(severity: str) -> int:
    return _ORDER.index(severity) if severity in _ORDER else 1


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def inert_text(text: str) -> str:
    r"""``text`` on one line: control characters (newlines, escapes) written as ``\xNN``.

    >>> print(inert_text("loss\n[stability] CRITICAL forged"))
    loss\x0a[stability] CRITICAL forged
    """
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def chat_escape(text: str) -> str:
    """Escape ``&``, ``<``, ``>`` (Slack's control characters: ``<!channel>``, links).

    >>> chat_escape("<!channel> a&b")
    '&lt;!channel&gt; a&amp;b'
    """
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def format_slack(alert: Alert, suppressed: int = 0, mention: str = "") -> dict[str, Any]:
    """Slack incoming-webhook payload: ``text`` (notification fallback) + one mrkdwn block.

    Text from the run is escaped (:func:`chat_escape`); only ``mention`` is left as markup.

    >>> a = Alert(7, "L3", severity="critical", message="nonfinite(loss) -> skip")
    >>> p = format_slack(a, 0, "<!here>")
    >>> p["text"]
    '<!here> :rotating_light: [stability] CRITICAL step 7: nonfinite(loss) -&gt; skip'
    >>> p["blocks"][0]["text"]["text"].splitlines()[0]
    '<!here> :rotating_light: *stability* CRITICAL at step 7'
    """
    icon = {"critical": ":rotating_light:", "warning": ":warning:"}.get(alert.severity,
                                                                        ":information_source:")
    lead = f"{mention} " if mention and alert.severity == "critical" else ""
    text = f"{lead}{icon} {chat_escape(format_alert(alert))}"
    body = chat_escape(inert_text(alert.message or alert.reason)).replace("`", "'")
    lines = [f"{lead}{icon} *stability* {alert.severity.upper()} at step {alert.step}",
             f"```{body}```"]
    if suppressed:
        text += f" (+{suppressed} more alerts suppressed by rate limit)"
        lines.append(f"_+{suppressed} more alerts suppressed by the rate limit_")
    return {"text": text,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}}]}


def format_alert(alert: Alert, prefix: str = "[stability]") -> str:
    """One line of text for an alert.

    >>> format_alert(Alert(7, "r", severity="critical", message="rollback to 5"))
    '[stability] CRITICAL step 7: rollback to 5'
    >>> format_alert(Alert(7, "r", cause="lr", message="step 7: LR capped"))
    '[stability] WARNING step 7 (cause: lr): LR capped'
    """
    text = alert.message or alert.reason
    head = f"step {alert.step}: "
    if text.startswith(head):
        text = text[len(head):]
    cause = f" (cause: {alert.cause})" if getattr(alert, "cause", "") else ""
    return inert_text(f"{prefix} {alert.severity.upper()} step {alert.step}{cause}: {text}")


class EpisodeGate:
    """Bound an alert storm: per severity, at most ``max_per_episode`` alerts of an episode.

    Only alerts of ``severities`` are gated (the webhook gates criticals: its warnings have
    their own rate limit).  An episode is a run of alerts of one severity whose steps lie
    within ``gap_steps`` of the previous one (either way: a rollback sends the step back).
    Past ``max_per_episode``, an alert goes only if ``remind_s`` seconds passed since the last
    one that went; the others are coalesced and their count rides on the next alert that goes
    (:meth:`admit` returns it).

    >>> g = EpisodeGate(max_per_episode=2, gap_steps=10, remind_s=3600)
    >>> [g.admit(Alert(s, "x", severity="critical"))[0] for s in range(5)]
    [True, True, False, False, False]
    >>> g.admit(Alert(100, "x", severity="critical"))   # a new episode: 3 were coalesced
    (True, 3)
    """

    def __init__(self, max_per_episode: int = 3, gap_steps: int = 100, remind_s: float = 60.0,
                 clock: Callable[[], float] | None = None,
                 severities: Iterable[str] = ("warning", "critical")) -> None:
        if max_per_episode < 1 or gap_steps < 0 or remind_s <= 0:
            raise ValueError("EpisodeGate needs max_per_episode >= 1, gap_steps >= 0 and "
                             "remind_s > 0.")
        self.max_per_episode = int(max_per_episode)
        self.gap_steps = int(gap_steps)
        self.remind_s = float(remind_s)
        self.clock = clock or time.monotonic
        self.severities = frozenset(severities)  # the others always go
        # severity -> [last step, sent in this episode, coalesced since the last sent, t sent]
        self._state: dict[str, list[float]] = {}

    def admit(self, alert: Alert) -> tuple[bool, int]:
        """``(goes, coalesced)``: whether ``alert`` goes out, and how many alerts coalesced
        before it that its message should mention (0 when it does not go)."""
        if alert.severity not in self.severities:
            return True, 0
        now = self.clock()
        st = self._state.get(alert.severity)
        if st is None or abs(int(alert.step) - st[0]) > self.gap_steps or alert.step < 0:
            pending = 0 if st is None else int(st[2])
            self._state[alert.severity] = [int(alert.step), 1, 0, now]
            return True, pending
        st[0] = int(alert.step)
        if st[1] < self.max_per_episode or now - st[3] >= self.remind_s:
            pending = int(st[2])
            st[1], st[2], st[3] = st[1] + 1, 0, now
            return True, pending
        st[2] += 1
        return False, 0

    def pending(self) -> int:
        """Alerts coalesced and not yet mentioned by any alert that went out."""
        return int(sum(st[2] for st in self._state.values()))

    def take_pending(self) -> int:
        """:meth:`pending`, and forget them (they are reported now)."""
        n = self.pending()
        for st in self._state.values():
            st[2] = 0
        return n


def _with_count(alert: Alert, coalesced: int) -> Alert:
    """``alert`` whose message mentions ``coalesced`` alerts that did not go out."""
    if not coalesced:
        return alert
    note = f" (+{coalesced} more alerts of this episode coalesced)"
    return dataclasses.replace(alert, message=(alert.message or alert.reason) + note)


class AlertSink:
    """Base class: ``send`` delivers or drops, never raises; failures are reported once."""

    name = "sink"

    def __init__(self, gate: EpisodeGate | None = None) -> None:
        self.stats: collections.Counter[str] = collections.Counter()
        self._reported = False
        self.gate = gate if gate is not None else EpisodeGate()

    def send(self, alert: Alert) -> None:
        """Deliver ``alert`` (or queue it) unless its episode's storm bound coalesces it;
        never raises."""
        try:
            goes, coalesced = self.gate.admit(alert)
            if not goes:
                self.stats["coalesced"] += 1
                return
            self._send(_with_count(alert, coalesced))
            self.stats["sent"] += 1
        except Exception as e:  # a sink must never break training
            self._failed(e)

    def _report_coalesced(self) -> None:
        """At close: one last alert with the count of coalesced alerts not yet mentioned."""
        n = self.gate.take_pending()
        if n:
            try:
                self._send(Alert(-1, "storm", severity="warning",
                                 message=f"{n} more alerts of the last episode were coalesced"))
            except Exception as e:
                self._failed(e)

    def _send(self, alert: Alert) -> None:
        raise NotImplementedError

    def _failed(self, e: BaseException) -> None:
        self.stats["failed"] += 1
        if not self._reported:
            self._reported = True
            logger.warning("stability alert sink %s failed (%s: %s); further failures are "
                           "counted, not reported.", self.name, type(e).__name__, e)

    def close(self, timeout: float | None = None) -> None:
        """Release resources (flushing what is pending within ``timeout`` seconds); the count
        of coalesced alerts not yet mentioned goes out in one last message."""
        self._report_coalesced()


class LoggingSink(AlertSink):
    """Alerts as log records on the ``stability.outputs.alerts`` logger (the default sink)."""

    name = "logging"

    def __init__(self, logger_name: str = "stability.alerts", min_severity: str = "info") -> None:
        super().__init__()
        self.logger = logging.getLogger(logger_name)
        self.min_severity = min_severity

    def _send(self, alert: Alert) -> None:
        if _rank(alert.severity) < _rank(self.min_severity):
            return
        self.logger.log(_LEVELS.get(alert.severity, logging.WARNING), format_alert(alert))


class FileSink(AlertSink):
    """Alerts appended to a text file, one line each (opened per write; flushed)."""

    name = "file"

    def __init__(self, path: str | os.PathLike[str], min_severity: str = "info") -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.min_severity = min_severity

    def _send(self, alert: Alert) -> None:
        if _rank(alert.severity) < _rank(self.min_severity):
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {format_alert(alert)}\n")


class RateLimiter:
    """At most ``max_events`` per sliding ``window_s`` seconds.

    >>> t = [0.0]
    >>> rl = RateLimiter(2, 10.0, clock=lambda: t[0])
    >>> [rl.allow() for _ in range(3)]
    [True, True, False]
    >>> t[0] = 11.0; rl.allow()
    True
    """

    def __init__(self, max_events: int, window_s: float,
                 clock: Callable[[], float] | None = None) -> None:
        if max_events < 1 or window_s <= 0:
            raise ValueError("RateLimiter needs max_events >= 1 and window_s > 0.")
        self.max_events = max_events
        self.window_s = window_s
        self.clock = clock or time.monotonic
        self._times: collections.deque[float] = collections.deque()

    def allow(self, force: bool = False) -> bool:
        """Record an event and say whether it may go (``force`` always goes and counts)."""
        now = self.clock()
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if force or len(self._times) < self.max_events:
            self._times.append(now)
            return True
        return False


class WebhookSink(AlertSink):
    """POST ``{"text": ...}`` (Slack-compatible) to ``url`` from a background thread.

    Parameters
    ----------
    url : str
        The webhook URL.
    timeout : float
        Wall-clock seconds per HTTP request, all of it (connect, send, status line, headers):
        every socket operation gets only the time left before that deadline.  A request
        past it fails (reported once, counted in ``stats["failed"]``).
    max_queue : int
        Bounded queue; when full a warning is dropped (counted) -- a critical alert replaces
        the oldest queued warning instead.
    max_per_window, window_s : int, float
        Warnings beyond ``max_per_window`` per ``window_s`` seconds are coalesced: counted, and
        mentioned ("+N more alerts suppressed") in the next message that goes out.
    min_severity : str
        Alerts below this severity are ignored.
    format : {"plain", "slack"}
        ``"plain"`` posts ``{"text": ...}`` (what Slack, Mattermost, Teams-compatible and most
        chat webhooks accept); ``"slack"`` adds an icon and a mrkdwn block (:func:`format_slack`).
    escalate : bool
        Critical alerts bypass the warnings' rate limit and go ahead of queued warnings
        (default); with ``False`` they are rate limited like warnings.  Either way a storm of
        them is bounded per episode (:class:`EpisodeGate`: 3 per episode, then one reminder a
        minute, the rest coalesced into the count of the next message).
    mention : str
        Prefixed to critical alerts, e.g. ``"<!here>"`` or ``"<@U123>"`` (escalation to people).
    """

    name = "webhook"

    def __init__(self, url: str, *, timeout: float = 5.0, max_queue: int = 100,
                 max_per_window: int = 5, window_s: float = 60.0,
                 min_severity: str = "warning", clock: Callable[[], float] | None = None,
                 headers: dict[str, str] | None = None, format: str = "plain",
                 escalate: bool = True, mention: str = "") -> None:
        super().__init__()
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"The 'url' parameter of WebhookSink must be http(s). Got {url!r}.")
        if timeout <= 0 or max_queue < 1:
            raise ValueError("WebhookSink needs timeout > 0 and max_queue >= 1.")
        if format not in ("plain", "slack"):
            raise ValueError("The 'format' parameter of WebhookSink must be 'plain' or 'slack'. "
                             f"Got {format!r} instead.")
        self.url = url
        self.format = format
        self.escalate = bool(escalate)
        self.mention = mention
        self.timeout = float(timeout)
        self.max_queue = int(max_queue)
        self.min_severity = min_severity
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.limiter = RateLimiter(max_per_window, window_s, clock)
        self.gate = EpisodeGate(clock=clock, severities=("critical",))
        self._queue: collections.deque[tuple[Alert, int]] = collections.deque()
        self._cond = threading.Condition()
        self._suppressed = 0
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stability-webhook", daemon=True)
        self._thread.start()

    def send(self, alert: Alert) -> None:
        """Queue ``alert`` (non-blocking; never raises)."""
        try:
            order = ("info", "warning", "critical")
            if order.index(alert.severity if alert.severity in order else "warning") < order.index(
                    self.min_severity):
                self.stats["ignored"] += 1
                return
            critical = alert.severity == "critical" and self.escalate
            with self._cond:
                if self._stop:
                    self.stats["dropped"] += 1
                    return
                if not self.gate.admit(alert)[0]:  # the episode's storm bound (criticals too)
                    self._suppressed += 1  # (one count here: it rides on the next message)
                    self.stats["coalesced"] += 1
                    return
                if not self.limiter.allow(force=critical):
                    self._suppressed += 1
                    self.stats["coalesced"] += 1
                    return
                if len(self._queue) >= self.max_queue:
                    victim = next((i for i, (a, _) in enumerate(self._queue)
                                   if a.severity != "critical"), None)
                    if not critical or victim is None:
                        self.stats["dropped"] += 1
                        return
                    del self._queue[victim]
                    self.stats["dropped"] += 1
                suppressed, self._suppressed = self._suppressed, 0
                if critical:  # escalation: ahead of every queued warning
                    pos = next((i for i, (a, _) in enumerate(self._queue)
                                if a.severity != "critical"), len(self._queue))
                    self._queue.insert(pos, (alert, suppressed))
                else:
                    self._queue.append((alert, suppressed))
                self._cond.notify()
        except Exception as e:
            self._failed(e)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                alert, suppressed = self._queue.popleft()
                self._busy = True
            try:
                self._post(alert, suppressed)
                self.stats["sent"] += 1
            except Exception as e:  # user-written sinks too
                self._failed(e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _post(self, alert: Alert, suppressed: int) -> None:
        if self.format == "slack":
            payload = format_slack(alert, suppressed, self.mention)
        else:
            text = chat_escape(format_alert(alert))
            if self.mention and alert.severity == "critical":
                text = f"{self.mention} {text}"
            if suppressed:
                text += f" (+{suppressed} more alerts suppressed by rate limit)"
            payload = {"text": text}
        body = json.dumps(payload).encode()
        req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        opener = deadline_opener(time.monotonic() + self.timeout)
        with opener.open(req, timeout=self.timeout) as resp:
            if resp.status >= 300:
                raise urllib.error.HTTPError(self.url, resp.status, "webhook error", resp.headers,
                                             None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is drained (at most ``timeout`` s); ``True`` if drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 5.0) -> None:
        """Deliver what is queued within ``timeout`` seconds, then stop the thread."""
        with self._cond:
            if self._suppressed and not self._stop:
                last = Alert(-1, "rate limit", severity="warning",
                             message="alerts were suppressed by the rate limit")
                self._queue.append((last, self._suppressed))
                self._suppressed = 0
                self._cond.notify()
        self.flush(timeout)
        with self._cond:
            self._stop = True
            n = len(self._queue)
            self._queue.clear()
            self.stats["dropped"] += n
            self._cond.notify_all()
        self._thread.join(0 if timeout is None else max(timeout, 0.0) + 0.1)


class AlertRouter:
    """Fan an alert out to several sinks; one broken sink never affects the others.

    >>> r = AlertRouter()                     # default: a LoggingSink
    >>> r.send(Alert(1, "x", message="hi")); [type(s).__name__ for s in r.sinks]
    ['LoggingSink']
    """

    def __init__(self, sinks: Iterable[AlertSink] | None = None) -> None:
        self.sinks: list[AlertSink] = list(sinks) if sinks is not None else [LoggingSink()]

    def send(self, alert: Alert) -> None:
        for s in self.sinks:
            try:
                s.send(alert)
            except Exception as e:
                logger.warning("alert sink %r raised %s: %s", s, type(e).__name__, e)

    def close(self, timeout: float | None = 5.0) -> None:
        for s in self.sinks:
            try:
                s.close(timeout)
            except Exception as e:
                logger.warning("closing alert sink %r raised %s: %s", s, type(e).__name__, e)


def make_sink(spec: dict[str, Any]) -> AlertSink:
    """Build a sink from config data: ``{"type": "logging"|"file"|"webhook", ...kwargs}``.

    >>> type(make_sink({"type": "file", "path": "alerts.txt"})).__name__
    'FileSink'
    """
    spec = dict(spec)
    kind = spec.pop("type", "logging")
    if kind == "logging":
        return LoggingSink(**spec)
    if kind == "file":
        return FileSink(**spec)
    if kind == "webhook":
        return WebhookSink(**spec)
    raise ValueError(f"Unknown alert sink type {kind!r}; known: logging, file, webhook.")


def sinks_from_config(cfg: Any = None) -> list[AlertSink]:
    """The alert sinks of an ``[alerts]`` table (default: one :class:`LoggingSink`).

    ``cfg`` is an :class:`~stability.config.config.AlertsConfig`, a
    :class:`~stability.config.config.MonitorConfig` (its ``alerts``), a mapping (validated) or
    ``None``.
    A webhook whose ``url_env`` variable is unset is left out with one warning: a missing secret
    must not stop a training run.

    >>> [type(s).__name__ for s in sinks_from_config()]
    ['LoggingSink']
    >>> sinks_from_config({"log": False})
    []
    """
    from stability.config.config import AlertsConfig

    if cfg is None:
        cfg = AlertsConfig()
    elif hasattr(cfg, "alerts") and not isinstance(cfg, AlertsConfig):
        cfg = cfg.alerts
    elif not isinstance(cfg, AlertsConfig):
        cfg = AlertsConfig.from_dict(cfg)
    sinks: list[AlertSink] = []
    if cfg.log:
        sinks.append(LoggingSink(min_severity=cfg.min_severity))
    if cfg.file is not None:
        sinks.append(FileSink(cfg.file, min_severity=cfg.min_severity))
    hook = cfg.webhook
    if hook is not None:
        url = hook.url
        if hook.url_env is not None:
            url = os.environ.get(hook.url_env) or url
        if not url:
            logger.warning("[alerts.webhook]: environment variable %s is not set; no webhook "
                           "alerts for this run.", hook.url_env)
        else:
            sinks.append(WebhookSink(url, timeout=hook.timeout, max_queue=hook.max_queue,
                                     max_per_window=hook.max_per_window, window_s=hook.window_s,
                                     min_severity=hook.min_severity, format=hook.format,
                                     escalate=hook.escalate, mention=hook.mention))
    return sinks


def event_log_from_config(cfg: Any = None) -> Any:
    """The :class:`~stability.outputs.events.EventLog` of an ``[event_log]`` table, or ``None``.

    ``cfg`` is an :class:`~stability.config.config.EventLogConfig`, a
    :class:`~stability.config.config.MonitorConfig` (its ``event_log``), a mapping or ``None``
    (no ``path``: no event log).

    >>> event_log_from_config() is None
    True
    """
    from stability.config.config import EventLogConfig

    if cfg is None:
        return None
    if hasattr(cfg, "event_log") and not isinstance(cfg, EventLogConfig):
        cfg = cfg.event_log
    elif not isinstance(cfg, EventLogConfig):
        cfg = EventLogConfig.from_dict(cfg)
    if cfg.path is None:
        return None
    from stability.outputs.events import EventLog

    return EventLog(cfg.path, fsync=cfg.fsync)
