"""``sync="deferred"`` in the trainer callbacks (HF Transformers, Lightning).

Both callbacks take ``sync="auto"`` by default (:mod:`stability.adapters.guard.sync_mode`: deferred
on CUDA with a fused optimizer, else step), resolved when the callback builds its guard at the
start of training.  The callbacks drive a :class:`TrainerGuard` -- a
:class:`~stability.adapters.torch.TorchGuard` whose ``sync="deferred"`` machinery
(:mod:`stability.adapters.guard.deferred`) runs unchanged: the callback calls ``check`` in the
trainer's pre-optimizer hook and ``finish`` at the end of the step, the trainer steps the
optimizer and the scheduler itself.  What the trainers add:

* **Saves.** A trainer checkpoint is registered with the health of the step it covers, and its
  state carries the monitor's; with ``sync="deferred"`` that step is not observed yet when the
  trainer saves.  On a step with a save due the callback therefore observes it first
  (:func:`observe_before_save`, i.e.
  :meth:`~stability.adapters.torch.TorchGuard.flush`):
  one host sync on save steps only (the save itself copies every weight to the host), and the
  checkpoint is registered, or cancelled, as with ``sync="step"``.  A stop or rollback found
  then is carried out at once.
* **Emergency checkpoints** are trainer saves too: a decision observed during step ``t + 1``
  asking for one gets it at the end of step ``t + 1`` (weights after that step's update, or
  none if the step was voided by a rollback); never an in-memory copy.
* **Voided steps.** A stop or rollback observed during step ``t + 1`` voids that step (its
  gradients are dropped: the trainer's optimizer step changes nothing), but the trainer counts it:
  ``global_step == guard.step_count + guard.steps_lost + guard.voided_steps``.  The trainer still
  steps its scheduler on a voided step (a rollback restores it; after a stop it is one step on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from stability.adapters.guard.sync_mode import check_sync
from stability.adapters.torch import TorchGuard
from stability.adapters.torch_ops.signals import Signals
from stability.adapters.trainer_support import finish_deferring_emergency
from stability.types import Decision

__all__ = ["TrainerGuard", "check_sync", "finish_step", "observe_before_save",
           "pending_grad_norm", "pending_scalars"]


class TrainerGuard(TorchGuard):
    """The guard of the trainer callbacks: a :class:`TorchGuard` whose ``sync="deferred"``
    emergency checkpoints are left to the trainer, and which counts voided steps.  It follows
    :class:`~stability.adapters.protocol.TrainerGuardSeam` (``check`` -> ``finish_step`` ->
    ``observe_before_save`` -> ``state_dict``), the protocol every trainer adapter drives.

    Attributes
    ----------
    emergency : str or None
        ``sync="deferred"``: the reason of an emergency checkpoint observed and not yet written
        (the callback writes it through the trainer at the end of the step).
    voided_steps : int
        Steps voided by a late stop or rollback (``sync="deferred"``; in the state dict).
    """

    emergency: str | None = None
    voided_steps: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the callbacks build their guard once the optimizer exists and the model is placed:
        # sync="auto" is resolved now, before the first hook asks which path to take
        self.resolve_sync()

    def _decide(self, step: int, sig: Signals) -> Decision:
        decision = super()._decide(step, sig)
        if self.deferred is not None and self.control.save_checkpoint:
            self.emergency = self.control.checkpoint_reason or "emergency"
            self.control = dataclasses.replace(self.control, save_checkpoint=False)
        return decision

    def check(self, loss: Any, metrics: Mapping[str, Any] | None = None,
              signals: Signals | None = None) -> Decision:
        decision = super().check(loss, metrics, signals)
        if self.deferred is not None and not self.should_step:
            self.voided_steps += 1  # only a late stop / rollback withholds a deferred step
        return decision

    # ------------------------------------------------------------------ the adapter seam
    def finish_step(self) -> tuple[bool, str, bool]:
        """End the step (see :func:`finish_step`): ``(emergency, reason, rolled_back)``."""
        return finish_step(self)

    def observe_before_save(self) -> tuple[bool, str, bool]:
        """Before a trainer save (see :func:`observe_before_save`)."""
        return observe_before_save(self)

    def take_emergency(self) -> tuple[bool, str]:
        """``(asked, reason)`` of an emergency checkpoint observed since the last call."""
        why, self.emergency = self.emergency, None
        return why is not None, why or ""

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.voided_steps:
            sd["voided_steps"] = self.voided_steps
        return sd

    def load_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> None:
        sd = dict(sd)
        voided = sd.pop("voided_steps", 0)
        if isinstance(voided, bool) or not isinstance(voided, int) or voided < 0:
            raise ValueError("TorchGuard state field 'voided_steps' must be an int >= 0. Got "
                             f"{voided!r} instead.")
        super().load_state_dict(sd, strict=strict)
        self.voided_steps = voided

    state_dict.__doc__ = TorchGuard.state_dict.__doc__
    load_state_dict.__doc__ = TorchGuard.load_state_dict.__doc__


def finish_step(guard: TrainerGuard) -> tuple[bool, str, bool]:
    """``guard.finish()`` with the emergency checkpoint left to the trainer's own save.

    Returns ``(emergency, reason, rolled_back)``: whether the decision carried out (``sync=
    "step"``: this step's; ``"deferred"``: the one observed during this step) asked for an
    emergency checkpoint, why, and whether ``finish`` rolled back.
    """
    if guard.deferred is None:
        ctl, emergency, rolled = finish_deferring_emergency(guard)
        return emergency, ctl.checkpoint_reason, rolled
    guard.finish()
    emergency, why = guard.take_emergency()
    return emergency, why, guard.rolled_back


def observe_before_save(guard: TrainerGuard) -> tuple[bool, str, bool]:
    """Before a trainer save: observe the pending step (``sync="deferred"``; nothing to do with
    ``sync="step"``) and carry out its decision.

    Returns ``(emergency, reason, rolled_back)``: whether that decision asked for an emergency
    checkpoint (and why), and whether the guard has rolled back since the last ``finish``.
    """
    if guard.deferred is not None and guard.deferred.pending is not None:
        guard.flush()  # (raise_on_stop is False in the callbacks: a stop sets guard.stopped)
    emergency, why = guard.take_emergency()
    return emergency, why, guard.rolled_back


def pending_grad_norm(guard: TrainerGuard) -> float:
    """The pre-clip gradient norm of the pending (not yet observed) step; ``nan`` when none.
    Waits for its copy: call it where the trainer synchronises anyway (a logging step)."""
    return float(pending_scalars(guard).get("grad_norm", math.nan))


def pending_scalars(guard: TrainerGuard) -> dict[str, float]:
    """The scalar signals of the pending (not yet observed) step, as floats (``{}`` when
    none).  Waits for their copy: call it where the trainer synchronises anyway (a logging
    step)."""
    p = guard.deferred.pending if guard.deferred is not None else None
    if p is None or p.step != guard.step_count - 1:
        return {}
    return {k: float(v) for k, v in p.signals().scalars.items()}
