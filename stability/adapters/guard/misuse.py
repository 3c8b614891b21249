"""Misuse of :class:`~stability.adapters.torch.TorchGuard`: one clear warning per kind.

A guard used the wrong way must never pass silently (the run would look monitored while
nothing is), nor crash the user's run where it can go on.  :class:`MisuseChecks` is held by the
guard and warns once per kind (``UserWarning``; later occurrences are counted in
:attr:`MisuseChecks.counts`):

=================  ===========================================================================
``no_gradients``   ``guard.step`` / ``check`` found no gradient: ``loss.backward()`` was not
                   called (the monitor sees no gradient signal; the optimizer step is a no-op)
``double_step``    ``guard.step`` called again for the same loss (twice per batch): the second
                   call finds the gradients already consumed
``scheduler``      the scheduler given to ``attach`` was also stepped by the loop: it advances
                   twice per step (``guard.step`` already steps it)
=================  ===========================================================================

Where nothing sensible can follow the guard raises instead: :func:`check_scheduler_arg` makes
``attach(model, opt, Monitor(...))`` (the monitor in the scheduler slot) a ``TypeError`` at
``attach``.  Bad metric values and steps going backwards are the monitor's to warn about
(:meth:`stability.monitor.layout.LayoutMixin._bad`).
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from typing import Any

__all__ = ["MisuseChecks", "check_scheduler_arg"]


def check_scheduler_arg(scheduler: Any) -> None:
    """``TypeError`` unless ``scheduler`` is ``None`` or has a ``step()`` method.

    >>> check_scheduler_arg(None)
    >>> from stability.monitor.monitor import Monitor
    >>> check_scheduler_arg(Monitor("small"))
    Traceback (most recent call last):
    ...
    TypeError: attach(model, optimizer, scheduler, monitor): the third argument is the LR \
scheduler, and a Monitor was given. Pass it by name: attach(model, optimizer, monitor=...).
    """
    if scheduler is None or callable(getattr(scheduler, "step", None)):
        return
    if callable(getattr(scheduler, "observe", None)):
        raise TypeError("attach(model, optimizer, scheduler, monitor): the third argument is the "
                        f"LR scheduler, and a {type(scheduler).__name__} was given. Pass it by "
                        "name: attach(model, optimizer, monitor=...).")
    raise TypeError("The 'scheduler' parameter of TorchGuard must be an LR scheduler (an object "
                    f"with a step() method) or None. Got {type(scheduler).__name__} instead.")


class MisuseChecks:
    """The guard's misuse checks (see the module docstring).

    Parameters
    ----------
    guard : TorchGuard
        Read: ``collector.params`` and ``scheduler``.
    """

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        #: occurrences of each kind (the first one warned)
        self.counts: Counter[str] = Counter()
        self._last_loss: Any = None          # weak reference to the previous step's loss
        self._sched_epoch: int | None = None  # scheduler.last_epoch after the guard stepped it

    def warn(self, kind: str, message: str) -> None:
        """Warn about ``kind`` the first time only; count every occurrence."""
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            warnings.warn(f"stability: {message} (warned once)", UserWarning, stacklevel=4)

    def before_check(self, loss: Any) -> None:
        """At ``guard.check`` (after ``backward()``): gradients present, scheduler not stepped
        by the loop since the guard stepped it."""
        if not self._has_gradients():
            same = self._last_loss is not None and loss is not None and \
                self._last_loss() is loss
            if same:
                self.warn("double_step", "guard.step() was called twice for the same loss; "
                          "call it once per batch, after loss.backward()")
            else:
                self.warn("no_gradients", "guard.step() found no gradients; call "
                          "loss.backward() before guard.step() (nothing was learnt this step)")
        self._remember(loss)
        self._check_scheduler()

    def scheduler_stepped(self) -> None:
        """The guard just stepped the scheduler: remember where it is."""
        epoch = getattr(self.guard.scheduler, "last_epoch", None)
        self._sched_epoch = epoch if isinstance(epoch, int) else None

    def _has_gradients(self) -> bool:
        params = getattr(getattr(self.guard, "collector", None), "params", None)
        if not params:
            return True  # nothing to judge by
        return any(p.grad is not None for p in params)

    def _remember(self, loss: Any) -> None:
        try:
            self._last_loss = weakref.ref(loss) if loss is not None else None
        except TypeError:  # a float loss: no weak reference (and no double step to tell)
            self._last_loss = None

    def _check_scheduler(self) -> None:
        sched, before = self.guard.scheduler, self._sched_epoch
        now = getattr(sched, "last_epoch", None)
        if before is None or not isinstance(now, int) or now <= before:
            return  # (a restore moves it back: fine)
        self.warn("scheduler", f"the LR scheduler given to attach() was also stepped by the "
                  f"training loop (last_epoch {now}, the guard left it at {before}): it advances "
                  "twice per step. guard.step() steps it already; remove the loop's "
                  "scheduler.step() (or do not pass the scheduler to attach)")
        self._sched_epoch = now
