"""The trainer-adapter protocol: what a callback for a trainer (HF Transformers, Lightning, ...)
drives, written down once.

A trainer adapter is one file: a callback of the trainer that builds a
:class:`~stability.adapters.trainer_deferred.TrainerGuard` once the optimizer exists and the
model is placed, and calls it from the trainer's hooks in this order, every optimizer step:

1. ``guard.check(loss, metrics)`` -- after ``backward()``, before the trainer's
   ``optimizer.step()`` (its pre-optimizer hook).  Signals in, decision made, gradients
   clipped / dropped; the trainer then steps the optimizer and the scheduler itself.
2. ``guard.finish_step()`` -- at the end of the step: checkpoints, rollback, stop.  Returns
   ``(emergency, reason, rolled_back)``: an emergency checkpoint is the adapter's to write
   through the trainer (only if the weights are finite), a rollback asks the trainer to skip
   its own save of this step.
3. ``guard.observe_before_save()`` -- before any trainer save: with ``sync="deferred"`` the
   step is observed first, so the checkpoint is registered with its health; same return.
4. ``guard.state_dict()`` / ``guard.load_state_dict()`` -- carried inside the trainer's own
   checkpoint (the adapter's ``state_dict`` / ``load_state_dict``), so a resume gives the same
   future decisions.

Plus, where the trainer offers them: ``guard.validation(val_loss)`` after an evaluation,
``guard.metrics()`` for the trainer's logger (:func:`~stability.adapters.trainer_support.
last_step_feedback`), ``guard.store = TrainerCheckpointStore(loader, writer)`` so rollbacks
restore the trainer's own checkpoints, and ``guard.detach()`` at the end of training.  A stop
sets ``guard.stopped`` (``raise_on_stop=False``); the adapter turns it into the trainer's own
stop flag.

:class:`TrainerGuardSeam` is the guard side, :class:`TrainerAdapter` the callback side; both
are ``typing.Protocol`` classes (``runtime_checkable``), checked for every adapter in
``tests/adapters/test_protocol.py``.  See ``docs/CONTRACTS.md`` ("Trainer adapters").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from stability.types import Decision

__all__ = ["TrainerAdapter", "TrainerGuardSeam"]


@runtime_checkable
class TrainerGuardSeam(Protocol):
    """What a trainer adapter calls on its guard, in this order every optimizer step:
    :meth:`check` -> (trainer steps) -> :meth:`finish_step` -> :meth:`observe_before_save`
    (before a trainer save) -> :meth:`state_dict` (inside the trainer's checkpoint)."""

    step_count: int
    stopped: Any
    rolled_back: bool
    sync_mode: str

    def check(self, loss: Any, metrics: Mapping[str, Any] | None = None,
              signals: Any = None) -> Decision:
        """Measure, decide and prepare the optimizer step (before ``optimizer.step()``)."""
        ...

    def finish_step(self) -> tuple[bool, str, bool]:
        """End the step: ``(emergency checkpoint asked, its reason, rolled back)``."""
        ...

    def observe_before_save(self) -> tuple[bool, str, bool]:
        """Before a trainer save: observe a pending step; same return as :meth:`finish_step`."""
        ...

    def validation(self, val_loss: float, **metrics: float) -> None:
        """Hand in a validation result (it joins the next step's metrics)."""
        ...

    def metrics(self, scores: bool = True) -> dict[str, float]:
        """The ``stability/*`` metrics for the trainer's logger."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The guard's state, carried in the trainer's checkpoint."""
        ...

    def load_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` output."""
        ...

    def detach(self) -> None:
        """Observe a pending step and remove every hook (end of training)."""
        ...


@runtime_checkable
class TrainerAdapter(Protocol):
    """The callback side: a trainer callback holding the monitor and (once training started)
    its guard, whose state travels in the trainer's checkpoint."""

    monitor: Any
    guard: Any  # a TrainerGuardSeam once training started, else None

    def feedback(self) -> dict[str, float]:
        """The guard's ``stability/*`` metrics of the last optimizer step (empty before)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The callback's state (the guard's and the monitor's), for the trainer's checkpoint."""
        ...

    def load_state_dict(self, sd: Any) -> None:
        """Restore :meth:`state_dict` output."""
        ...
