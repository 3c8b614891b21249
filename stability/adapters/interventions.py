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
import json
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
    "safe_torch_load",
    "save_checkpoint",
]


def safe_torch_load(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` with ``weights_only=True``: a checkpoint directory is not trusted code.

    Tensors, containers, numbers and strings load; a pickled class or function (arbitrary code on
    unpickling) is refused with a ``ValueError`` naming the file and the global.  To allow a type
    you trust, register it with :func:`torch.serialization.add_safe_globals` before loading.

    >>> import tempfile, os, torch
    >>> p = os.path.join(tempfile.mkdtemp(), "x.pt"); torch.save({"w": torch.ones(2)}, p)
    >>> safe_torch_load(p)["w"].tolist()
    [1.0, 1.0]
    """
    import pickle  # only for the exception type

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        detail = next((ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln),
                      first[0] if first else "")
        raise ValueError(
            f"{os.fspath(path)}: refused to unpickle a non-tensor object ({detail}); checkpoints "
            "are loaded with weights_only=True. If you trust this type, allow it with "
            "torch.serialization.add_safe_globals([...]) before loading") from exc


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
        return _cpu_copy(snap)
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
        snap = safe_torch_load(source)
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


def retention_victims(entries: Mapping[int, SavedCheckpoint], keep: int,
                      protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete: all but the ``keep`` newest healthy checkpoints, the newest emergency
    (unhealthy) one and the ``protect`` ones (rollback targets still needed).

    >>> e = {s: SavedCheckpoint(s, s, s != 30, "", None) for s in (10, 20, 30, 40)}
    >>> retention_victims(e, keep=1), retention_victims(e, keep=1, protect={10})
    ([10, 20], [20])
    """
    steps = sorted(entries)
    healthy = [s for s in steps if entries[s].healthy]
    kept = {s for s in protect if s in entries}
    kept.update(healthy[-keep:])
    kept.update([s for s in steps if not entries[s].healthy][-1:])
    return [s for s in steps if s not in kept]


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

    On disk, an index (``index[-rank<r>].json``, JSON data, written atomically after every save
    and delete) lists the checkpoints with their health flags, so a store created on the same
    directory after a restart knows them again (entries whose file is gone are left out).
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
        self._read_index()

    # ------------------------------------------------------------------ on-disk index
    def _index_path(self) -> Path | None:
        if self.directory is None:
            return None
        suffix = "" if self.rank < 0 else f"-rank{self.rank}"
        return self.directory / f"index{suffix}.json"

    def _read_index(self) -> None:
        path = self._index_path()
        if path is None or not path.is_file():
            return
        try:
            rows = json.loads(path.read_text())["entries"]
            for r in rows:
                f = self.directory / str(r["file"])  # type: ignore[operator]
                if f.is_file():
                    step = int(r["step"])
                    self.entries[step] = SavedCheckpoint(
                        step, int(r["data_position"]), bool(r["healthy"]), str(r["reason"]),
                        str(f))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a bad index: start empty
            log.warning("checkpoint index %s unreadable (%s: %s); ignoring it", path,
                        type(exc).__name__, exc)
            self.entries = {}

    def _write_index(self) -> None:
        path = self._index_path()
        if path is None:
            return
        rows = [{"step": e.step, "data_position": e.data_position, "healthy": e.healthy,
                 "reason": e.reason, "file": Path(e.path).name}
                for _, e in sorted(self.entries.items()) if e.path is not None]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 1, "entries": rows}))
            os.replace(tmp, path)
        except OSError as exc:  # the checkpoints themselves are fine; the next save retries
            log.debug("could not write the checkpoint index %s: %s", path, exc)

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
        self._write_index()
        return entry

    def _prune(self, protect: Iterable[int] = ()) -> None:
        for s in retention_victims(self.entries, self.keep, protect):
            self.drop(s)

    def drop(self, step: int) -> None:
        """Forget (and delete) the checkpoint of ``step``."""
        entry = self.entries.pop(step, None)
        self._memory.pop(step, None)
        if entry is not None and entry.path and os.path.exists(entry.path):
            os.unlink(entry.path)
        if entry is not None and entry.path is not None:
            self._write_index()
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
