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
  memory and knows which were healthy.

torch is imported here at module level: this module is only imported through
``stability.adapters`` entry points that are documented to need torch.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("stability.adapters")

__all__ = [
    "CheckpointStore",
    "LRMultiplier",
    "SavedCheckpoint",
    "TrainingStopped",
    "clip_gradients",
    "drop_gradients",
    "load_checkpoint",
    "save_checkpoint",
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
        self, reason: str, step: int = -1, alarms: tuple[Any, ...] = (), decision: Any = None
    ) -> None:
        super().__init__(f"training stopped at step {step}: {reason}")
        self.reason = reason
        self.step = step
        self.alarms = alarms
        self.decision = decision


# ---------------------------------------------------------------------------- learning rate
class LRMultiplier:
    """Hold an LR multiplier on top of whatever the scheduler sets.

    Writing ``param_groups[i]["lr"]`` once is undone by the next ``LambdaLR.step()`` (and
    compounds with recursive schedulers such as ``StepLR``). Instead the multiplier is applied
    inside ``optimizer.step()`` only: a step pre-hook scales each group's LR by ``factor`` and a
    post-hook writes the scheduler's value back. The scheduler therefore always reads and writes
    its own, unscaled values, and the update uses ``scheduler LR * factor``.

    A value changed between steps by anyone (scheduler, user) is taken as the new base.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The optimizer whose groups are scaled.
    factor : float
        Initial multiplier (1.0 = untouched).

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
    >>> p.grad = torch.ones(1); opt.step(); sched.step()
    >>> round(p.item(), 6)  # LambdaLR.step() did not undo the factor
    -0.2
    >>> mult.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float = 1.0) -> None:
        self.optimizer = optimizer
        self.factor = float(factor)
        n = len(optimizer.param_groups)
        self._base: list[float] = [float(g["lr"]) for g in optimizer.param_groups]
        self._written: list[float | None] = [None] * n
        self._pre = optimizer.register_step_pre_hook(self._on_pre_step)
        self._post = optimizer.register_step_post_hook(self._on_post_step)

    # hooks have the signature hook(optimizer, args, kwargs)
    def _on_pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.apply()

    def _on_post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.restore()

    def apply(self) -> None:
        """Scale every group's LR by ``factor`` (called right before the optimizer step)."""
        groups = self.optimizer.param_groups
        if len(self._base) != len(groups):  # groups added with add_param_group
            self._base = [float(g["lr"]) for g in groups]
            self._written = [None] * len(groups)
        for i, g in enumerate(groups):
            lr = g["lr"]
            if self._written[i] is None or lr != self._written[i]:
                self._base[i] = float(lr)  # the scheduler (or user) set a new value
            if self.factor != 1.0:
                g["lr"] = _set_like(lr, self._base[i] * self.factor)
            self._written[i] = float(g["lr"])

    def restore(self) -> None:
        """Write the scheduler's own LR back (called right after the optimizer step)."""
        for i, g in enumerate(self.optimizer.param_groups[: len(self._base)]):
            if self._written[i] is not None and g["lr"] == self._written[i]:
                g["lr"] = _set_like(g["lr"], self._base[i])
                self._written[i] = self._base[i]

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

    def remove(self) -> None:
        """Detach the hooks (the groups keep the scheduler's values)."""
        self.restore()
        self._pre.remove()
        self._post.remove()


def _set_like(old: Any, value: float) -> Any:
    """Keep a tensor LR a tensor (``lr=torch.tensor(...)`` is allowed by some optimizers)."""
    if isinstance(old, torch.Tensor):
        return old.new_tensor(value)
    return value


# ---------------------------------------------------------------------------- gradients
def _grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def clip_gradients(
    params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float | None = None
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
    grads = _grads(params)
    if grads:
        torch._foreach_mul_(grads, coef)
    return coef


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


# ---------------------------------------------------------------------------- checkpoints
def _cpu_copy(obj: Any) -> Any:
    """Deep copy of a state dict with every tensor moved to CPU (for in-memory checkpoints)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items()) if isinstance(
            obj, OrderedDict) else {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _scheduler_state(scheduler: Any) -> Any:
    return None if scheduler is None else scheduler.state_dict()


def save_checkpoint(
    path: str | os.PathLike[str] | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    step: int = 0,
    data_position: int = 0,
    monitor_state: Mapping[str, Any] | None = None,
    healthy: bool = True,
    reason: str = "",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Snapshot the training state; write it atomically when ``path`` is given.

    The file is written to a temporary name in the same directory, flushed, fsynced and renamed
    over ``path``, so a crash leaves either the old file or the new one, never half a file.

    Parameters
    ----------
    path : path-like or None
        Destination file, or ``None`` to only return the snapshot (tensors copied to CPU).
    model, optimizer, scheduler
        Objects with ``state_dict()``; optimizer and scheduler may be ``None``.
    step, data_position : int
        Monitor step and index of the next batch to read.
    monitor_state : mapping, optional
        ``Monitor.state_dict()`` (JSON data).
    healthy : bool
        Health flag recorded with the checkpoint.
    reason : str
        Why it was taken ("periodic", "emergency: loss_spike", ...).
    extra : mapping, optional
        Anything else to store.

    Returns
    -------
    dict
        The snapshot (``"model"``, ``"optimizer"``, ``"scheduler"``, ``"monitor"``, ``"step"``,
        ``"data_position"``, ``"healthy"``, ``"reason"``, ``"extra"``, ``"version"``).
    """
    snap: dict[str, Any] = {
        "version": 1,
        "step": int(step),
        "data_position": int(data_position),
        "healthy": bool(healthy),
        "reason": reason,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": _scheduler_state(scheduler),
        "monitor": None if monitor_state is None else dict(monitor_state),
        "extra": dict(extra or {}),
        "rng": torch.get_rng_state(),
    }
    if path is None:
        return _cpu_copy(snap)  # type: ignore[no-any-return]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(snap, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return snap


def load_checkpoint(
    source: str | os.PathLike[str] | Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore model, optimizer and scheduler in place from a file or an in-memory snapshot.

    Returns the snapshot so the caller can restore the monitor state and data position.
    """
    if isinstance(source, Mapping):
        snap = dict(source)
    else:
        snap = torch.load(source, map_location="cpu", weights_only=False)
    model.load_state_dict(snap["model"])
    if optimizer is not None and snap.get("optimizer") is not None:
        optimizer.load_state_dict(_cpu_copy(snap["optimizer"]))
    if scheduler is not None and snap.get("scheduler") is not None:
        scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))
    return snap


@dataclass(frozen=True)
class SavedCheckpoint:
    """Bookkeeping entry of :class:`CheckpointStore`."""

    step: int
    data_position: int
    healthy: bool
    reason: str
    path: str | None


class CheckpointStore:
    """Keep the last ``keep`` checkpoints on disk (``directory``) or in memory (``None``).

    Parameters
    ----------
    directory : path-like or None
        Where files ``step-<N>[-rank<r>].pt`` go; ``None`` keeps CPU copies in memory.
    keep : int
        How many *healthy* checkpoints to retain (older ones are deleted).  Emergency
        (unhealthy) checkpoints never evict a healthy one: only the newest of them is kept, on
        top of ``keep``.  Steps passed as ``protect`` to :meth:`save` (the rollback target of an
        open episode) are never deleted.
    rank : int
        Suffix for per-rank files in distributed runs (``-1`` = no suffix).
    on_drop : callable, optional
        ``on_drop(step)`` after a checkpoint is deleted (e.g. to forget it in the ledger, so a
        rollback is never planned onto a deleted checkpoint).
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, keep: int = 4, rank: int = -1,
        on_drop: Any = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"The 'keep' parameter of CheckpointStore must be >= 1. Got {keep}.")
        self.directory = None if directory is None else Path(directory)
        self.keep = int(keep)
        self.rank = int(rank)
        self.entries: dict[int, SavedCheckpoint] = {}
        self._memory: dict[int, dict[str, Any]] = {}
        self.on_drop = on_drop

    def _path(self, step: int) -> Path | None:
        if self.directory is None:
            return None
        suffix = "" if self.rank < 0 else f"-rank{self.rank}"
        return self.directory / f"step-{step:09d}{suffix}.pt"

    def save(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, *, step: int,
             data_position: int, healthy: bool, reason: str = "",
             monitor_state: Mapping[str, Any] | None = None,
             protect: Iterable[int] = ()) -> SavedCheckpoint:
        """Take a checkpoint and register it; returns its entry.

        ``protect``: steps whose checkpoints retention must not delete now.
        """
        path = self._path(step)
        snap = save_checkpoint(path, model, optimizer, scheduler, step=step,
                               data_position=data_position, monitor_state=monitor_state,
                               healthy=healthy, reason=reason)
        if path is None:
            self._memory[step] = snap
        entry = SavedCheckpoint(step, data_position, healthy, reason,
                                None if path is None else str(path))
        self.entries[step] = entry
        self._prune(protect)
        return entry

    def _prune(self, protect: Iterable[int] = ()) -> None:
        steps = sorted(self.entries)
        healthy = [s for s in steps if self.entries[s].healthy]
        unhealthy = [s for s in steps if not self.entries[s].healthy]
        keep = {s for s in protect if s in self.entries}
        keep.update(healthy[-self.keep:])
        keep.update(unhealthy[-1:])
        for s in steps:
            if s not in keep:
                self.drop(s)

    def drop(self, step: int) -> None:
        """Forget (and delete) the checkpoint of ``step``."""
        entry = self.entries.pop(step, None)
        self._memory.pop(step, None)
        if entry is not None and entry.path and os.path.exists(entry.path):
            os.unlink(entry.path)
        if entry is not None and self.on_drop is not None:
            try:
                self.on_drop(step)
            except Exception:  # bookkeeping must never kill the run
                log.debug("on_drop(%s) failed", step, exc_info=True)

    def latest_healthy(self, at_or_before: int | None = None) -> SavedCheckpoint | None:
        """Newest healthy checkpoint at or before a step (``None`` if there is none)."""
        cands = [e for s, e in self.entries.items() if e.healthy
                 and (at_or_before is None or s <= at_or_before)]
        return max(cands, key=lambda e: e.step) if cands else None

    def restore(self, step: int, model: torch.nn.Module, optimizer: Any,
                scheduler: Any) -> dict[str, Any]:
        """Load the checkpoint of ``step`` in place; returns its snapshot."""
        entry = self.entries.get(step)
        if entry is None:
            raise KeyError(f"No checkpoint for step {step}; have {sorted(self.entries)}")
        source: Any = self._memory[step] if entry.path is None else entry.path
        return load_checkpoint(source, model, optimizer, scheduler)
