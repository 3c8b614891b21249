"""Stall watchdog: notice when training stops making progress (a hung collective, a dead loader).

The trainer calls :meth:`StallWatchdog.beat` once per completed step -- a clock read and a few
attribute stores, no lock.  A daemon thread wakes at the current deadline and, when no step has
completed within ``k x`` the recent median step time (never less than ``min_timeout_s``, armed
after ``warmup_steps`` step times), reports a *stall* once: all thread stacks are dumped with
:func:`faulthandler.dump_traceback` (to ``dump_path`` or stderr) and a :class:`StallEvent` goes
to the callbacks, the alert sinks and the event log.  When steps resume, a *recovery* event
records how long the stall lasted (and the goodput ledger is told the time lost).  The watchdog
never kills or interrupts the process: what to do about a hang is a human's (or the scheduler's)
call.

It also turns beats into signals for the monitor: :meth:`StallWatchdog.metrics` gives
``step_time`` (seconds), ``throughput`` (tokens or samples per second, given ``tokens_per_step``
or ``samples_per_step``) and ``mfu`` (given ``flops_per_step`` and ``peak_flops``), ready to
pass to ``Monitor.observe`` so a level-shift detector can watch for slowdowns.

Examples
--------
>>> events = []
>>> t = [0.0]
>>> wd = StallWatchdog(k=3.0, min_timeout_s=0.5, warmup_steps=3, clock=lambda: t[0],
...                    on_stall=events.append, on_recover=events.append, dump_stacks=False,
...                    autostart=False)     # checked by hand below; normally a thread polls
>>> for step in range(5):            # 0.2 s per step
...     t[0] += 0.2
...     wd.beat(step)
>>> round(wd.timeout_s, 3)           # max(0.5, 3 x 0.2)
0.6
>>> t[0] += 1.0; _ = wd.poll()       # no step for 1 s: stalled
>>> events[0].kind, events[0].step
('stall', 4)
>>> t[0] += 0.5; wd.beat(5)          # steps resume after 1.5 s
>>> events[1].kind, round(events[1].duration_s, 3), round(events[1].excess_s, 3)
('recovered', 1.5, 1.3)
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from detectors.validation import check_bool, check_float, check_int, check_opt_float
from stability.types import Alarm, Alert

logger = logging.getLogger("stability.watchdog")

#: Alarm kind of a stall (see :data:`stability.types.ALARM_KINDS`).
STALL_KIND = "stall"


@dataclass(frozen=True)
class StallEvent:
    """A stall (``kind="stall"``) or the end of one (``kind="recovered"``).

    ``step`` is the last completed step before the stall; ``duration_s`` the time since that
    step's beat (when reported; for a recovery, the whole gap); ``excess_s`` the part of the gap
    beyond a normal step (``duration_s - median_step_s``, what the goodput ledger books as
    stalled); ``stacks_path`` where the stacks went (``None``: stderr or not dumped).
    """

    kind: str
    step: int | None
    duration_s: float
    timeout_s: float
    median_step_s: float
    excess_s: float = 0.0
    stacks_path: str | None = None

    @property
    def message(self) -> str:
        if self.kind == STALL_KIND:
            return (f"no step completed for {self.duration_s:.3g}s after step {self.step} "
                    f"(timeout {self.timeout_s:.3g}s; median step {self.median_step_s:.3g}s)"
                    + (f"; stacks in {self.stacks_path}" if self.stacks_path else ""))
        return (f"steps resumed after a {self.duration_s:.3g}s stall at step {self.step} "
                f"({self.excess_s:.3g}s lost)")

    def to_alarm(self) -> Alarm:
        """The stall as an :class:`~stability.types.Alarm` of kind ``"stall"``."""
        return Alarm(-1 if self.step is None else int(self.step), STALL_KIND, "step_time",
                     self.duration_s, self.timeout_s,
                     "critical" if self.kind == STALL_KIND else "info", "watchdog", self.message)

    def to_alert(self) -> Alert:
        """An :class:`~stability.types.Alert` for the alert sinks."""
        return Alert(-1 if self.step is None else int(self.step), reason=f"{self.kind}(step_time)",
                     severity="critical" if self.kind == STALL_KIND else "info",
                     message=self.message)

    def to_record(self) -> dict[str, Any]:
        """An event-log record ``{"type": "stall" | "stall_recovered", ...}``."""
        d = dataclasses.asdict(self)
        d.pop("kind")
        d["type"] = "stall" if self.kind == STALL_KIND else "stall_recovered"
        d["message"] = self.message
        return d


def format_stacks() -> str:
    """All threads' Python stacks as text (the fallback when ``faulthandler`` has no file)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {names.get(ident, '?')} ({ident:#x}):\n")
        out.extend(traceback.format_stack(frame))
    return "".join(out)


class StallWatchdog:
    """Daemon thread that reports steps that stop completing; see the module docstring.

    Parameters
    ----------
    k : float
        A stall is ``k x`` the median of the last ``window`` step times without a beat.
    min_timeout_s : float
        Floor of the timeout (short steps jitter; a hang is never sub-second).
    warmup_steps : int
        Step times needed before the watchdog arms (first steps compile, load, warm caches).
    window : int
        How many recent step times the median is taken over.
    on_stall, on_recover : callable, optional
        Called with the :class:`StallEvent` (from the watchdog thread for a stall, from the
        thread that called :meth:`beat` for a recovery).  Exceptions are logged and contained.
    sinks : iterable of alert sinks
        Each gets ``send(event.to_alert())`` (e.g. the monitor's ``alert_sinks``).
    event_log : EventLog, optional
        Gets ``append(event.to_record())``.
    goodput : GoodputTracker, optional
        Gets ``note_stall(event.excess_s)`` on recovery.
    dump_stacks : bool
        Dump all thread stacks once per stall.
    dump_path : path-like, optional
        Append the stacks to this file (default: stderr).
    tokens_per_step, samples_per_step, flops_per_step, peak_flops : float, optional
        Turn step times into ``throughput`` and ``mfu`` in :meth:`metrics`.
    poll_max_s : float
        Longest the thread sleeps between checks (it otherwise sleeps until the deadline).
    autostart : bool
        Start the thread on the first :meth:`beat` (else call :meth:`start`, or use ``with``).
    clock : callable
        Monotonic clock (default :func:`time.monotonic`).
    """

    def __init__(self, *, k: float = 5.0, min_timeout_s: float = 60.0, warmup_steps: int = 3,
                 window: int = 64, on_stall: Callable[[StallEvent], Any] | None = None,
                 on_recover: Callable[[StallEvent], Any] | None = None,
                 sinks: Iterable[Any] = (), event_log: Any = None, goodput: Any = None,
                 dump_stacks: bool = True, dump_path: str | os.PathLike[str] | None = None,
                 tokens_per_step: float | None = None, samples_per_step: float | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None,
                 poll_max_s: float = 1.0, autostart: bool = True,
                 clock: Callable[[], float] | None = None) -> None:
        owner = "StallWatchdog"
        self.k = check_float(owner, "k", k, 1.0, high_open=True)
        self.min_timeout_s = check_float(owner, "min_timeout_s", min_timeout_s, 0.0,
                                         high_open=True)
        self.poll_max_s = check_float(owner, "poll_max_s", poll_max_s, 1e-3, high_open=True)
        self.warmup_steps = check_int(owner, "warmup_steps", warmup_steps, 1)
        self.window = check_int(owner, "window", window, 1)
        self.tokens_per_step, self.samples_per_step, self.flops_per_step, self.peak_flops = (
            check_opt_float(owner, name, v, 0.0, low_open=True, high_open=True)
            for name, v in (("tokens_per_step", tokens_per_step),
                            ("samples_per_step", samples_per_step),
                            ("flops_per_step", flops_per_step), ("peak_flops", peak_flops)))
        self.dump_stacks = check_bool(owner, "dump_stacks", dump_stacks)
        self.autostart = check_bool(owner, "autostart", autostart)
        self.on_stall = on_stall
        self.on_recover = on_recover
        self.sinks = list(sinks)
        self.event_log = event_log
        self.goodput = goodput
        self.dump_path = None if dump_path is None else os.fspath(dump_path)
        self._clock = clock or time.monotonic
        # hot path state: written by beat() only (plain stores, atomic under the GIL)
        self._times: collections.deque[float] = collections.deque(maxlen=self.window)
        self._last: float | None = None
        self._step: int | None = None
        self._beats = 0
        # stall state: changed under _lock (rare paths only)
        self._lock = threading.RLock()
        self._stalled = False
        self._stall: StallEvent | None = None
        self._stall_beats = 0
        self._stall_last = 0.0
        self.stalls: list[StallEvent] = []          #: stalls reported so far
        self.recoveries: list[StallEvent] = []      #: recoveries reported so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed: set[int] = set()
        self._clock_warned = False

    @classmethod
    def for_monitor(cls, monitor: Any, **kwargs: Any) -> StallWatchdog:
        """A watchdog reporting through ``monitor``'s alert sinks and event log."""
        kwargs.setdefault("sinks", list(getattr(monitor, "alert_sinks", None) or ()))
        kwargs.setdefault("event_log", getattr(monitor, "event_log", None))
        return cls(**kwargs)

    # ------------------------------------------------------------------ hot path
    def beat(self, step: int | None = None) -> None:
        """A step completed (call once per optimizer step; starts the thread on first use).

        Cheap: a clock read, a deque append and attribute stores; a lock only when a stall
        is open (to report its recovery).
        """
        now = self._clock()
        last = self._last
        self._last = now
        self._step = step if step is not None else (0 if self._step is None else self._step + 1)
        self._beats += 1
        if self._stalled:
            self._recover(now)
        elif last is not None:
            self._note_interval(now - last)
        if self._thread is None and self.autostart and not self._closed:
            self.start()

    def _note_interval(self, dt: float) -> None:
        """Keep one step time; a clock that stepped back gives no step time (warned once),
        never a negative one."""
        if dt >= 0.0:
            self._times.append(dt)
            return
        if not self._clock_warned:
            self._clock_warned = True
            logger.warning("stall watchdog: the clock stepped back by %.3g s between two beats; "
                           "that interval is left out of the step times (reported once)", -dt)

    # ------------------------------------------------------------------ signals
    @property
    def median_step_s(self) -> float:
        """Median of the recent step times (``nan`` before the first two beats)."""
        try:
            xs = sorted(self._times)
        except RuntimeError:  # mutated while copying: retry once
            xs = sorted(list(self._times))
        if not xs:
            return math.nan
        n = len(xs)
        return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])

    @property
    def armed(self) -> bool:
        """Whether enough step times were seen to detect stalls."""
        return len(self._times) >= self.warmup_steps

    @property
    def timeout_s(self) -> float:
        """Stall threshold ``max(min_timeout_s, k x median step time)`` (``inf`` until armed)."""
        if not self.armed:
            return math.inf
        return max(self.min_timeout_s, self.k * self.median_step_s)

    @property
    def stalled(self) -> bool:
        """Whether a stall is open."""
        return self._stalled

    def metrics(self) -> dict[str, float]:
        """``step_time`` of the last step, and ``throughput`` / ``mfu`` when configured.

        Empty before the second beat.  Pass them to ``Monitor.observe(step, metrics)``.
        """
        if not self._times:
            return {}
        dt = self._times[-1]
        out = {"step_time": dt}
        per = self.tokens_per_step or self.samples_per_step
        if per is not None and dt > 0:
            out["throughput"] = per / dt
        if self.flops_per_step is not None and self.peak_flops is not None and dt > 0:
            out["mfu"] = self.flops_per_step / dt / self.peak_flops
        return out

    # ------------------------------------------------------------------ thread
    def start(self) -> StallWatchdog:
        """Start the daemon thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._closed = False
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="stability-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop and join the thread (beats after this do not restart it)."""
        self._closed = True
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def __enter__(self) -> StallWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.poll()
            except Exception:  # never let the watchdog die silently
                logger.exception("stall watchdog check failed")
                wait = self.poll_max_s
            self._stop.wait(wait)

    def poll(self, now: float | None = None) -> float:
        """One check (what the thread runs); returns how long to sleep until the next one."""
        now = self._clock() if now is None else now
        if self._stalled:
            if self._beats != self._stall_beats:   # a beat raced the stall report
                self._recover(now)
            return self.poll_max_s
        last, timeout = self._last, self.timeout_s
        if last is None or not math.isfinite(timeout):   # not armed yet
            return min(self.poll_max_s, max(self.min_timeout_s / 4, 1e-3))
        elapsed = now - last
        if elapsed < timeout:
            # sleep to the deadline; at most a quarter timeout (the median may still shrink)
            return min(max(timeout - elapsed, 1e-3) + 1e-3, timeout / 4, self.poll_max_s)
        with self._lock:  # held while reporting, so a recovery is never reported first
            if self._stalled or self._last != last:
                return self.poll_max_s
            self._stalled = True
            self._stall_beats = self._beats
            self._stall_last = last
            step = self._step
            path = self._dump(step, elapsed) if self.dump_stacks else None
            ev = StallEvent(STALL_KIND, step, elapsed, timeout, self.median_step_s,
                            stacks_path=path)
            self._stall = ev
            self.stalls.append(ev)
            logger.warning("stall: %s", ev.message)
            self._report(ev, self.on_stall)
        return self.poll_max_s

    def _recover(self, now: float) -> None:
        with self._lock:
            stall = self._stall
            if not self._stalled or stall is None:
                return
            self._stalled = False
            gap = max(now - self._stall_last, 0.0)
            med = stall.median_step_s
            ev = StallEvent("recovered", stall.step, gap, stall.timeout_s, med,
                            excess_s=max(gap - (med if math.isfinite(med) else 0.0), 0.0))
            self.recoveries.append(ev)
            logger.warning("stall over: %s", ev.message)
            if self.goodput is not None:
                self._call(self.goodput.note_stall, ev.excess_s)
            self._report(ev, self.on_recover)

    def _dump(self, step: int | None, elapsed: float) -> str | None:
        header = (f"\n=== stability watchdog: no step for {elapsed:.3g}s after step {step} "
                  f"(pid {os.getpid()}) ===\n")
        if self.dump_path is not None:
            try:
                with open(self.dump_path, "a") as f:
                    f.write(header)
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                return self.dump_path
            except Exception:
                logger.exception("could not dump stacks to %s", self.dump_path)
                return None
        try:
            sys.stderr.write(header)
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:  # stderr without a file descriptor (captured): Python's own format
            try:
                sys.stderr.write(format_stacks())
            except Exception:
                logger.debug("could not write stacks to stderr", exc_info=True)
        return None

    def _report(self, ev: StallEvent, callback: Callable[[StallEvent], Any] | None) -> None:
        if callback is not None:
            self._call(callback, ev)
        alert = ev.to_alert()
        for sink in self.sinks:
            self._call(sink.send, alert)
        if self.event_log is not None:
            self._call(self.event_log.append, ev.to_record())

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            key = id(fn.__self__) if hasattr(fn, "__self__") else id(fn)
            if key not in self._failed:
                self._failed.add(key)
                logger.warning("stall watchdog: %r failed (%s: %s); contained", fn,
                               type(e).__name__, e, exc_info=e)

    def __repr__(self) -> str:
        return (f"StallWatchdog(k={self.k}, min_timeout_s={self.min_timeout_s}, "
                f"timeout_s={self.timeout_s:.3g}, stalls={len(self.stalls)}, "
                f"stalled={self._stalled})")
