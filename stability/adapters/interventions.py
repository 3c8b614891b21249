"""Functions that carry out the monitor's requests on real PyTorch objects.

The monitor only *requests* (:class:`stability.types.Control`); these helpers *act*:

* :class:`LRMultiplier` -- an LR factor that survives any scheduler. It is applied by an
  optimizer step pre-hook and removed again by a post-hook, so between optimizer steps the
  ``param_groups`` hold the scheduler's own values and every scheduler (closed-form like
  ``LambdaLR`` / ``OneCycleLR``, or recursive like ``StepLR`` / ``ExponentialLR``) computes from
  what it wrote itself: no compounding, nothing undone by ``scheduler.step()``.
* :func:`clip_gradients` -- clip the real gradients at a norm, reusing an already measured total
  norm (no second pass over the gradients).
* :func:`drop_gradients` -- make the next ``optimizer.step()`` a no-op (``p.grad = None``), for
  trainers that call the step themselves (Lightning, HF).
* :func:`save_checkpoint` / :func:`load_checkpoint` -- atomic ``torch.save`` of model, optimizer,
  scheduler, monitor state and data position; :class:`CheckpointStore` keeps them on disk or in
  memory, recorded in a :class:`~stability.run.checkpoints.CheckpointLedger` (the monitor's: one
  registry decides what exists, what is pruned and what a rollback restores). These live in
  :mod:`stability.adapters.torch_ops.checkpoint_store` and are re-exported here, as is
  :func:`safe_torch_load`.

torch is imported here at module level: this module is only imported through
``stability.adapters`` entry points that are documented to need torch.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stability.adapters.torch_ops.checkpoint_store import (
    CheckpointStore,
    SavedCheckpoint,
    load_checkpoint,
    safe_torch_load,
    save_checkpoint,
)
from stability.adapters.torch_ops.checkpoint_store import retention_victims as retention_victims

log = logging.getLogger("stability.adapters")

__all__ = [
    "CheckpointStore",
    "LRMultiplier",
    "SavedCheckpoint",
    "TrainingStopped",
    "clip_gradients",
    "drop_gradients",
    "load_checkpoint",
    "restore_outcome",
    "safe_torch_load",
    "save_checkpoint",
    "tightest_clip",
]


class TrainingStopped(RuntimeError):
    """Raised by an adapter when the monitor asks to stop training.

    Parameters
    ----------
    reason : str
        Why the monitor stopped the run (the ``Control.stop_reason``).
    step : int
        Step at which the stop was requested.
    alarms : tuple
        The :class:`stability.types.Alarm` objects of that step.
    decision : object, optional
        The full :class:`stability.types.Decision`.

    Examples
    --------
    >>> e = TrainingStopped("nonfinite loss", step=12)
    >>> str(e), e.step
    ('training stopped at step 12: nonfinite loss', 12)
    """

    def __init__(
        self, reason: str, step: int = -1, alarms: tuple[Any, ...] = (), decision: Any = None,
        restored_step: int | None = None,
    ) -> None:
        super().__init__(f"training stopped at step {step}: {reason}")
        self.reason = reason
        self.step = step
        self.alarms = alarms
        self.decision = decision
        #: the step whose (healthy) checkpoint the model holds now (``None``: none restored)
        self.restored_step = restored_step


def restore_outcome(reason: str, target: int | None, restored: int | None, step: int) -> str:
    """A stop's ``reason`` made true to what happened to the weights.

    The policy decides a stop together with the restore of a healthy checkpoint and says so
    ("... with the weights of step N restored"); the guard carries the restore out afterwards,
    and it can fail (no loadable checkpoint) or fall back to an older one.  The claim about
    step ``target`` is then replaced by what the model holds: the checkpoint of step
    ``restored``, or (``None``) the weights of ``step``, kept.  A reason without the claim gets
    the outcome appended; a restore that worked leaves the reason unchanged.

    Examples
    --------
    >>> r = "step 40: loss up -> stop with the weights of step 25 restored (cause: lr)"
    >>> restore_outcome(r, 25, 25, 40) == r
    True
    >>> print(restore_outcome(r, 25, None, 40))  # doctest: +NORMALIZE_WHITESPACE
    step 40: loss up -> stop with the weights of step 40 kept (the checkpoint of step 25 could
    not be restored) (cause: lr)
    >>> print(restore_outcome("stop; the weights of step 25 (the latest healthy) restored",
    ...                       25, 10, 40))
    stop; the weights of step 10 restored (the checkpoint of step 25 could not be restored)
    """
    if target is None or restored == target:
        return reason
    held = (f"the weights of step {step} kept" if restored is None
            else f"the weights of step {restored} restored")
    failed = f"the checkpoint of step {target} could not be restored"
    claim = re.compile(rf"the weights of step {int(target)}(?: \([^)]*\))? restored")
    if claim.search(reason):
        return claim.sub(f"{held} ({failed})", reason, count=1)
    return f"{reason}; {failed}: {held}"


# ---------------------------------------------------------------------------- learning rate
class LRMultiplier:
    """Hold an LR multiplier on top of whatever the scheduler sets.

    Writing ``param_groups[i]["lr"]`` once is undone by the next ``LambdaLR.step()`` (and
    compounds with recursive schedulers such as ``StepLR``). Instead the multiplier keeps the
    scheduler's own value (the *base*) per group and writes ``base * factor`` only while it
    matters:

    * an optimizer step pre-hook writes ``base * factor`` (the update uses the effective LR) and a
      post-hook writes the base back, so a scheduler stepped right after the optimizer reads and
      writes its own, unscaled values -- no compounding, nothing undone by ``scheduler.step()``;
    * :meth:`show` (the guard calls it at the end of every step) writes ``base * factor`` again,
      so *between* steps ``param_groups[i]["lr"]`` shows the LR really applied and the user's own
      LR logging is right.

    A value changed by anyone else (scheduler, user) is taken as the new base.  When the group
    showed a cut value and the ``scheduler`` given here stepped once meanwhile (a per-epoch
    scheduler stepped outside the guard), the new base is what the scheduler computes from the
    *base* (``get_lr()`` evaluated on the base values), so a recursive scheduler (``StepLR``,
    ``ExponentialLR``, ``CosineAnnealingLR``) does not compound the cut; closed-form ones
    (``LambdaLR``, ``OneCycleLR``) give their own value anyway.  ``ReduceLROnPlateau`` (no
    ``get_lr``) is treated as recursive.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer whose groups are scaled.
    factor : float
        Initial multiplier (1.0 = untouched).
    scheduler : LR scheduler, optional
        The scheduler of the optimizer, used only to resolve the case above.

    Examples
    --------
    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(1))
    >>> opt = torch.optim.SGD([p], lr=1.0)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    >>> mult = LRMultiplier(opt)
    >>> mult.factor = 0.1
    >>> p.grad = torch.ones(1); opt.step(); sched.step()
    >>> round(p.item(), 6), opt.param_groups[0]["lr"]  # stepped with 0.1; scheduler value kept
    (-0.1, 1.0)
    >>> mult.show(); opt.param_groups[0]["lr"]  # between steps: the effective LR
    0.1
    >>> p.grad = torch.ones(1); opt.step(); sched.step()
    >>> round(p.item(), 6)  # LambdaLR.step() did not undo the factor
    -0.2
    >>> mult.remove(); opt.param_groups[0]["lr"]
    1.0
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float = 1.0,
                 scheduler: Any = None) -> None:
        self.optimizer = optimizer
        self.factor = float(factor)
        self.scheduler = scheduler
        n = len(optimizer.param_groups)
        self._base: list[float] = [float(g["lr"]) for g in optimizer.param_groups]
        self._written: list[float | None] = [None] * n
        self._written_factor: list[float] = [1.0] * n
        self._sched_epoch = self._epoch()
        self._pre = optimizer.register_step_pre_hook(self._on_pre_step)
        self._post = optimizer.register_step_post_hook(self._on_post_step)

    # hooks have the signature hook(optimizer, args, kwargs)
    def _on_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.apply()

    def _on_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.restore()

    def _epoch(self) -> int | None:
        e = getattr(self.scheduler, "last_epoch", None)
        return e if isinstance(e, int) else None

    def _sync(self) -> None:
        """Take values written by someone else as the new bases (see the class docstring)."""
        groups = self.optimizer.param_groups
        if len(self._base) != len(groups):  # groups added with add_param_group
            self._base = [float(g["lr"]) for g in groups]
            self._written = [None] * len(groups)
            self._written_factor = [1.0] * len(groups)
        changed = [i for i, g in enumerate(groups)
                   if self._written[i] is None or g["lr"] != self._written[i]]
        if not changed:
            return
        epoch = self._epoch()
        scaled = [i for i in changed
                  if self._written[i] is not None and self._written_factor[i] != 1.0]
        from_sched: list[float] | None = None
        if scaled and epoch is not None and self._sched_epoch is not None \
                and epoch == self._sched_epoch + 1:
            from_sched = self._scheduler_from_base()
        for i in changed:
            lr = float(groups[i]["lr"])
            if i in scaled and from_sched is not None and i < len(from_sched):
                self._base[i] = from_sched[i]
            elif i in scaled and from_sched is None and _is_plateau(self.scheduler) \
                    and epoch != self._sched_epoch:
                self._base[i] = lr / self._written_factor[i]
            else:
                self._base[i] = lr
            self._written[i] = None

    def _scheduler_from_base(self) -> list[float] | None:
        """``scheduler.get_lr()`` evaluated with the groups at their bases (``None``: n/a)."""
        sched = self.scheduler
        if sched is None or _is_plateau(sched) or not hasattr(sched, "get_lr"):
            return None
        groups = self.optimizer.param_groups
        now = [g["lr"] for g in groups]
        flag = getattr(sched, "_get_lr_called_within_step", None)
        try:
            for g, b in zip(groups, self._base, strict=False):
                g["lr"] = _set_like(g["lr"], b)
            if flag is not None:
                sched._get_lr_called_within_step = True
            return [float(v) for v in sched.get_lr()]
        except Exception:  # fall back to taking the written value
            return None
        finally:
            if flag is not None:
                sched._get_lr_called_within_step = flag
            for g, v in zip(groups, now, strict=False):
                g["lr"] = v

    def _write(self, factor: float) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            if factor != 1.0 or self._written[i] is None or g["lr"] != self._base[i]:
                g["lr"] = _set_like(g["lr"], self._base[i] * factor)
            self._written[i] = float(g["lr"])
            self._written_factor[i] = factor
        self._sched_epoch = self._epoch()

    def apply(self) -> None:
        """Write ``base * factor`` into every group (right before the optimizer step)."""
        self._sync()
        self._write(self.factor)

    def show(self) -> None:
        """Write the effective LR for display between steps (same as :meth:`apply`)."""
        self.apply()

    def restore(self) -> None:
        """Write the scheduler's own LR back (called right after the optimizer step)."""
        self._sync()
        self._write(1.0)

    def base_lrs(self) -> list[float]:
        """The scheduler's LR per group (what it would be without the multiplier)."""
        out = []
        for i, g in enumerate(self.optimizer.param_groups):
            if i < len(self._base) and self._written[i] is not None and g["lr"] == self._written[i]:
                out.append(self._base[i])
            else:
                out.append(float(g["lr"]))
        return out

    def effective_lrs(self) -> list[float]:
        """The LR the next optimizer step will use, per group."""
        return [lr * self.factor for lr in self.base_lrs()]

    def state_dict(self) -> dict[str, Any]:
        """Factor, bases and the values last written (JSON data, ``"version"`` key)."""
        return {"version": 1, "factor": self.factor, "base": list(self._base),
                "written": list(self._written), "written_factor": list(self._written_factor)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: an optimizer state saved while the groups showed a cut
        LR (between steps) is recognised, so the cut does not compound on resume."""
        self.factor = float(sd.get("factor", self.factor))
        base = [float(x) for x in sd.get("base", [])]
        if len(base) != len(self.optimizer.param_groups):
            return
        written = list(sd.get("written", [None] * len(base)))
        self._base = base
        self._written = [None if w is None else float(w) for w in written]
        self._written_factor = [float(x) for x in sd.get("written_factor", [1.0] * len(base))]
        self._sched_epoch = self._epoch()

    def remove(self) -> None:
        """Detach the hooks (the groups keep the scheduler's values)."""
        self.restore()
        self._pre.remove()
        self._post.remove()


def _is_plateau(sched: Any) -> bool:
    return type(sched).__name__ == "ReduceLROnPlateau"


def _set_like(old: Any, value: float) -> Any:
    """Keep a tensor LR a tensor (``lr=torch.tensor(...)`` is allowed by some optimizers)."""
    if isinstance(old, torch.Tensor):
        return old.new_tensor(value)
    return value


# ---------------------------------------------------------------------------- gradients
def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def clip_gradients(
    params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float | None = None,
    grads: list[torch.Tensor] | None = None,
) -> float:
    """Clip the global L2 norm of the gradients at ``max_norm``, in place.

    Parameters
    ----------
    params : iterable of Parameter
        Parameters whose ``.grad`` are clipped.
    max_norm : float
        Maximum global norm. Non-finite or non-positive values disable clipping.
    total_norm : float, optional
        The global norm if already measured (it is then not recomputed); otherwise
        :func:`torch.nn.utils.clip_grad_norm_` measures it.
    grads : list of Tensor, optional
        The gradients to scale when ``total_norm`` is given (default: the ``.grad`` of
        ``params``); sharded parameters pass their local shards
        (``SignalCollector.local_grads``), scaled by the global norm.

    Returns
    -------
    float
        The coefficient applied to the gradients (1.0 = not clipped).

    Examples
    --------
    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> round(clip_gradients([p], 1.0, total_norm=5.0), 4)
    0.2
    >>> [round(v, 4) for v in p.grad.tolist()]
    [0.6, 0.8]
    """
    params = list(params)
    if not (max_norm > 0 and math.isfinite(max_norm)):
        return 1.0
    if total_norm is None:
        total_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return min(1.0, max_norm / (total_norm + 1e-6)) if math.isfinite(total_norm) else 1.0
    if not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    coef = max_norm / (total_norm + 1e-6)
    grads = _grads(params) if grads is None else grads
    if grads:
        torch._foreach_mul_(grads, coef)
    return coef


def tightest_clip(a: float | None, b: float | None) -> float | None:
    """The tighter of two clip norms (``None``, non-finite and non-positive ones ignored).

    Examples
    --------
    >>> tightest_clip(1.0, 0.5), tightest_clip(None, 2.0), tightest_clip(float("nan"), None)
    (0.5, 2.0, None)
    """
    vals = [v for v in (a, b) if v is not None and math.isfinite(v) and v > 0]
    return min(vals) if vals else None


def drop_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Set every ``.grad`` to ``None`` so the next ``optimizer.step()`` changes nothing.

    Optimizers skip parameters without gradients entirely (no moment update, no step-count
    increment), which is what a skipped step must do. Zeroing the gradients instead would still
    move Adam's moments and apply weight decay.

    Examples
    --------
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(1)); p.grad = torch.ones(1)
    >>> opt = torch.optim.AdamW([p], lr=0.1); drop_gradients([p]); opt.step()
    >>> p.item(), opt.state_dict()["state"]
    (1.0, {})
    """
    for p in params:
        p.grad = None
