"""Preemption: take an emergency checkpoint when the scheduler sends SIGTERM, then exit as before.

Cluster schedulers (Slurm, Kubernetes, spot/preemptible VMs) announce preemption with SIGTERM and
kill the job a grace period later.  :func:`install_sigterm_checkpoint` runs a checkpoint callback
once when the signal arrives, then hands the signal to the handler that was installed before
(Python's default: the process terminates as it would have without us; a callable: it is
called; ``SIG_IGN``: nothing more happens).  A failing callback is logged, never raised: the
previous handler still runs.

Python runs signal handlers in the main thread between bytecodes, so the callback may do real
work (``torch.save``); it should be quick (the grace period is often 30 s).  Handlers can only
be installed from the main thread: elsewhere :func:`install_sigterm_checkpoint` logs a warning
and returns a handle that is not installed.

Examples
--------
>>> saved = []
>>> with install_sigterm_checkpoint(lambda: saved.append("ckpt"), chain=False) as h:
...     first, again = h.trigger(), h.trigger()   # what the signal does; only once
>>> h.installed, first, again, saved
(False, True, False, ['ckpt'])
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

logger = logging.getLogger("stability.preemption")


class SigtermCheckpoint:
    """An installed emergency-checkpoint handler (see :func:`install_sigterm_checkpoint`)."""

    def __init__(self, callback: Callable[[], Any],
                 signals: Iterable[int] = (signal.SIGTERM,), chain: bool = True) -> None:
        self.callback = callback
        self.signals = tuple(int(s) for s in signals)
        self.chain = bool(chain)
        self.fired = False           #: whether the callback ran
        self.received: int | None = None   #: the signal that arrived (``None``: none yet)
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> SigtermCheckpoint:
        """Install the handler (main thread only; elsewhere a warning and no-op)."""
        if self.installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            logger.warning("install_sigterm_checkpoint: not the main thread, so no signal handler "
                           "can be installed; emergency checkpoints on SIGTERM are off")
            return self
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers (only where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> SigtermCheckpoint:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def trigger(self) -> bool:
        """Run the checkpoint callback unless it already ran; ``True`` if it ran now."""
        with self._lock:
            if self.fired:
                return False
            self.fired = True
        try:
            self.callback()
        except Exception:
            logger.exception("emergency checkpoint on SIGTERM failed")
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        logger.warning("signal %s received: emergency checkpoint", signum)
        self.trigger()
        if self.chain:
            self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        prev = self._previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        elif prev is None or prev == signal.SIG_DFL:
            # what would have happened without us: the default action (terminate)
            signal.signal(signum, signal.SIG_DFL)
            self._previous.pop(signum, None)
            os.kill(os.getpid(), signum)


def install_sigterm_checkpoint(callback: Callable[[], Any], *,
                               signals: Iterable[int] = (signal.SIGTERM,),
                               chain: bool = True) -> SigtermCheckpoint:
    """On SIGTERM run ``callback()`` once (an emergency checkpoint), then the previous handler.

    Parameters
    ----------
    callback : callable
        Takes no arguments; saves what is needed to resume.  Exceptions are logged.
    signals : iterable of int
        Signals to catch (default SIGTERM; add ``signal.SIGUSR1`` for Slurm's
        ``--signal=USR1@60`` warning).
    chain : bool
        After the callback, hand the signal to the previous handler (default: the process
        exits as it would have).  ``False``: the training loop keeps running and should check
        :attr:`SigtermCheckpoint.received` to stop itself.

    Returns
    -------
    SigtermCheckpoint
        A handle: ``uninstall()`` (or leave its ``with`` block) restores the previous handlers.
    """
    return SigtermCheckpoint(callback, signals, chain).install()
