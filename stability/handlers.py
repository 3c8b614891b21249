"""User handlers for alarms and interventions, with failures contained.

A handler is any callable taking one argument (the :class:`~stability.types.Alarm` or the
:class:`~stability.types.Intervention`).  An exception in a handler is logged (with its traceback,
the first time for each handler) and recorded, and training goes on -- unless ``strict=True``, in
which case it propagates.  With ``timeout`` set, each handler runs in a daemon thread and a handler
still running after ``timeout`` seconds is abandoned (logged, not killed).

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
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .types import Alarm, Intervention

logger = logging.getLogger("stability.handlers")

F = TypeVar("F", bound=Callable[..., Any])


class HandlerError(RuntimeError):
    """Raised in strict mode when a handler times out."""


class HandlerRegistry:
    """Registered ``on_alarm`` / ``on_intervention`` callables.

    Parameters
    ----------
    strict : bool
        Re-raise handler exceptions (and raise :class:`HandlerError` on timeouts).
    timeout : float, optional
        Seconds a handler may run before it is abandoned (``None``: run inline, no limit).
    max_errors_kept : int
        Recent errors kept in :attr:`errors` as ``(handler name, item, repr(exception))``.
    """

    def __init__(self, strict: bool = False, timeout: float | None = None,
                 max_errors_kept: int = 100) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"The 'timeout' parameter of HandlerRegistry must be > 0 or None. "
                             f"Got {timeout!r} instead.")
        self.strict = strict
        self.timeout = timeout
        self.alarm_handlers: list[Callable[[Alarm], Any]] = []
        self.intervention_handlers: list[Callable[[Intervention], Any]] = []
        self.errors: deque[tuple[str, Any, str]] = deque(maxlen=max_errors_kept)
        self.n_errors = 0
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ registration
    def on_alarm(self, fn: F) -> F:
        """Register ``fn(alarm)``; usable as a decorator."""
        if not callable(fn):
            raise TypeError(f"on_alarm handler must be callable. Got {fn!r}.")
        self.alarm_handlers.append(fn)
        return fn

    def on_intervention(self, fn: F) -> F:
        """Register ``fn(intervention)``; usable as a decorator."""
        if not callable(fn):
            raise TypeError(f"on_intervention handler must be callable. Got {fn!r}.")
        self.intervention_handlers.append(fn)
        return fn

    def remove(self, fn: Callable[..., Any]) -> None:
        """Unregister ``fn`` from both lists (no error if absent)."""
        self.alarm_handlers = [h for h in self.alarm_handlers if h is not fn]
        self.intervention_handlers = [h for h in self.intervention_handlers if h is not fn]

    def __bool__(self) -> bool:
        return bool(self.alarm_handlers or self.intervention_handlers)

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
                if self.timeout is None:
                    h(item)
                else:
                    self._call_with_timeout(h, item)
                ok += 1
            except Exception as e:
                self._record(h, item, e)
                if self.strict:
                    raise
        return ok

    def _call_with_timeout(self, h: Callable[[Any], Any], item: Any) -> None:
        box: list[BaseException] = []

        def run() -> None:
            try:
                h(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box.append(e)

        t = threading.Thread(target=run, name=f"stability-handler-{_name(h)}", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            raise HandlerError(f"handler {_name(h)} still running after {self.timeout} s; "
                               f"abandoned")
        if box:
            raise box[0]

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
