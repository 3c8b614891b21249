"""User handlers for alarms and interventions, with failures contained and time bounded.

A handler is any callable taking one argument (the :class:`~stability.types.Alarm` or the
:class:`~stability.types.Intervention`).  An exception in a handler is logged (with its traceback,
the first time for each handler) and recorded, and training goes on -- unless ``strict=True``, in
which case it propagates.

Time bounds (``timeout`` set, the monitor's default): calls run on ONE worker thread while the
caller waits at most the time left.  Outside a step each call may take ``timeout`` seconds; between
:meth:`HandlerRegistry.begin_step` and :meth:`~HandlerRegistry.end_step` (the monitor opens one per
``observe()`` that emits) all calls of the step -- handlers and alert sinks -- share ONE budget of
``timeout`` seconds, so a step never waits much longer than that.  A call still running when its
time is up is *hung*: reported once, the worker is handed to it and replaced, and that handler is
not called again until it returns (its calls are dropped and counted in :attr:`n_dropped`).  Calls
left when the step's budget is spent are dropped the same way.  Threads are therefore bounded: one
worker plus one per handler that is hung right now.

Examples
--------
>>> from stability.types import Alarm
>>> hub = HandlerRegistry()
>>> seen = []
>>> @hub.on_alarm
... def remember(alarm):
...     seen.append(alarm.kind)
>>> @hub.on_alarm
... def broken(alarm):
...     raise RuntimeError("bug in user code")
>>> hub.alarm(Alarm(1, "loss_spike", "loss", 9.0, 6.0, "warning", "ewma_z"))
1
>>> seen, hub.n_errors
(['loss_spike'], 1)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, TypeVar

from detectors.validation import check_bool, check_int, check_opt_float, param_error
from stability.types import Alarm, Intervention

logger = logging.getLogger("stability.handlers")

F = TypeVar("F", bound=Callable[..., Any])

#: seconds an idle worker thread waits for work before it exits (a new one starts on demand)
WORKER_IDLE_S = 5.0


class HandlerError(RuntimeError):
    """A handler (or sink) call ran past its time; raised in strict mode, recorded otherwise."""


class _Call:
    """One handler call handed to the worker."""

    __slots__ = ("fn", "item", "key", "label", "done", "error", "finished", "hung")

    def __init__(self, fn: Callable[[Any], Any], item: Any, key: int, label: str) -> None:
        self.fn, self.item, self.key, self.label = fn, item, key, label
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.finished = False
        self.hung = False


class _Pool:
    """State shared by a registry and its worker threads (never a reference to the registry)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worker: _Worker | None = None
        self.hung: dict[int, _Call] = {}   # handler key -> its call still running

    def submit(self, call: _Call) -> _Worker:
        with self.lock:
            w = self.worker
            if w is None or not w.is_alive():  # (threads do not survive a fork)
                w = self.worker = _Worker(self)
                w.start()
            w.q.put(call)  # under the lock: an idle worker cannot exit with work queued
        return w


class _Worker(threading.Thread):
    """The one thread running handler calls; handed over to a call that hangs, then replaced."""

    def __init__(self, pool: _Pool) -> None:
        super().__init__(name="stability-handlers", daemon=True)
        self.pool = pool
        self.q: queue.SimpleQueue[_Call] = queue.SimpleQueue()

    def run(self) -> None:
        pool = self.pool
        while True:
            try:
                call = self.q.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with pool.lock:
                    if self.q.empty():
                        if pool.worker is self:
                            pool.worker = None
                        return
                continue
            try:
                call.fn(call.item)
            except BaseException as e:  # handed to the caller's thread
                call.error = e
            with pool.lock:
                call.finished = True
                if call.hung:  # the caller gave up on it: it may be called again now
                    pool.hung.pop(call.key, None)
            call.done.set()
            if call.hung:
                logger.info("stability handler %s returned after hanging; it is called again "
                            "from now on.", call.label)
                return  # a replacement worker took over
            call.item = None


class HandlerRegistry:
    """Registered ``on_alarm`` / ``on_intervention`` callables.

    Parameters
    ----------
    strict : bool
        Re-raise handler exceptions (and raise :class:`HandlerError` on timeouts).
    timeout : float, optional
        Seconds a call may take (outside a step) or all calls of a step may take together
        (between :meth:`begin_step` and :meth:`end_step`); ``None``: run inline, no limit.
    max_errors_kept : int
        Recent errors kept in :attr:`errors` as ``(handler name, item, repr(exception))``.

    Attributes
    ----------
    n_errors : int
        Calls that raised or hung.
    n_dropped : int
        Calls not made: the handler was still hung, or the step's budget was spent
        (per handler in :attr:`dropped`).
    """

    def __init__(self, strict: bool = False, timeout: float | None = None,
                 max_errors_kept: int = 100) -> None:
        owner = "HandlerRegistry"
        self.strict = check_bool(owner, "strict", strict)
        # finite: an Event.wait(inf) raises OverflowError (None means no limit)
        self.timeout = check_opt_float(owner, "timeout", timeout, 0.0, low_open=True,
                                       high_open=True)
        self.alarm_handlers: list[Callable[[Alarm], Any]] = []
        self.intervention_handlers: list[Callable[[Intervention], Any]] = []
        self.errors: deque[tuple[str, Any, str]] = deque(
            maxlen=check_int(owner, "max_errors_kept", max_errors_kept, 0))
        self.n_errors = 0
        self.n_dropped = 0
        self.dropped: Counter[str] = Counter()
        self._reported: set[str] = set()
        self._drop_reported: set[str] = set()
        self._pool = _Pool()
        self._deadline: float | None = None

    # ------------------------------------------------------------------ registration
    def on_alarm(self, fn: F) -> F:
        """Register ``fn(alarm)``; usable as a decorator."""
        if not callable(fn):
            raise TypeError(str(param_error("HandlerRegistry.on_alarm", "fn", "a callable", fn)))
        self.alarm_handlers.append(fn)
        return fn

    def on_intervention(self, fn: F) -> F:
        """Register ``fn(intervention)``; usable as a decorator."""
        if not callable(fn):
            raise TypeError(str(param_error("HandlerRegistry.on_intervention", "fn", "a callable",
                                            fn)))
        self.intervention_handlers.append(fn)
        return fn

    def remove(self, fn: Callable[..., Any]) -> None:
        """Unregister ``fn`` from both lists (no error if absent)."""
        self.alarm_handlers = [h for h in self.alarm_handlers if h is not fn]
        self.intervention_handlers = [h for h in self.intervention_handlers if h is not fn]

    def __bool__(self) -> bool:
        return bool(self.alarm_handlers or self.intervention_handlers)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (threads and hung calls are not carried over)."""
        state = self.__dict__.copy()
        del state["_pool"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = _Pool()

    @property
    def hung(self) -> list[str]:
        """Names of the handlers (and sinks) hung right now."""
        with self._pool.lock:
            return [c.label for c in self._pool.hung.values()]

    # ------------------------------------------------------------------ the step budget
    def begin_step(self) -> None:
        """Open a step: the calls until :meth:`end_step` share one budget of ``timeout`` s."""
        self._deadline = None if self.timeout is None else time.monotonic() + self.timeout

    def end_step(self) -> None:
        """Close the step opened by :meth:`begin_step`."""
        self._deadline = None

    # ------------------------------------------------------------------ dispatch
    def alarm(self, alarm: Alarm) -> int:
        """Call every alarm handler; returns how many succeeded."""
        return self._dispatch(self.alarm_handlers, alarm)

    def intervention(self, iv: Intervention) -> int:
        """Call every intervention handler; returns how many succeeded."""
        return self._dispatch(self.intervention_handlers, iv)

    def _dispatch(self, handlers: list[Callable[[Any], Any]], item: Any) -> int:
        ok = 0
        for h in list(handlers):
            try:
                if self.call(h, h, item):
                    ok += 1
            except Exception as e:
                self._record(h, item, e)
                if self.strict:
                    raise
        return ok

    def call(self, owner: Any, fn: Callable[[Any], Any], item: Any, label: str | None = None
             ) -> bool:
        """``fn(item)`` within the time left; ``False`` if dropped (hung owner or budget spent).

        ``owner`` identifies the handler (or alert sink) for the hung bookkeeping.  Exceptions
        of ``fn`` propagate; a call that runs out of time raises :class:`HandlerError` and its
        owner is not called again until the call returns.
        """
        if self.timeout is None:
            fn(item)
            return True
        label = label or _name(owner)
        pool = self._pool
        key = id(owner)
        if key in pool.hung:  # its hang was reported: "not called again until it returns"
            self._drop(label, None)
            return False
        now = time.monotonic()
        left = (self._deadline if self._deadline is not None else now + self.timeout) - now
        if left <= 0:
            self._drop(label, f"the step's handler budget of {self.timeout} s is spent")
            return False
        c = _Call(fn, item, key, label)
        pool.submit(c)
        if not c.done.wait(left):
            with pool.lock:
                if not c.finished:
                    c.hung = True
                    pool.hung[key] = c
                    pool.worker = None  # this worker now belongs to the hung call
            if c.hung:
                raise HandlerError(f"{label} still running after {left:.3g} s; abandoned (not "
                                   f"called again until it returns)")
            c.done.wait()
        if c.error is not None:
            err, c.error = c.error, None
            raise err
        return True

    def _drop(self, label: str, why: str | None) -> None:
        self.n_dropped += 1
        self.dropped[label] += 1
        if why is not None and label not in self._drop_reported:
            self._drop_reported.add(label)
            logger.warning("stability handler %s not called: %s. Further dropped calls are "
                           "counted (HandlerRegistry.n_dropped), not logged.", label, why)

    def _record(self, h: Callable[..., Any], item: Any, e: Exception) -> None:
        name = _name(h)
        self.n_errors += 1
        self.errors.append((name, item, repr(e)))
        if name not in self._reported:
            self._reported.add(name)
            logger.error("stability handler %s failed on %r; contained (strict=False). Further "
                         "failures of this handler are counted, not logged.", name, item,
                         exc_info=e)


def _name(h: Callable[..., Any]) -> str:
    return getattr(h, "__qualname__", None) or repr(h)
