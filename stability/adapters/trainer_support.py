"""Pieces shared by the HF Transformers and Lightning callbacks.

* :class:`TrainerCheckpointStore` -- the guard's rollback source when a *trainer* writes the
  checkpoints: entries point at the trainer's own checkpoints (an HF ``checkpoint-N`` directory, a
  Lightning ``.ckpt`` file), restored in place by a trainer-specific loader, so every checkpoint
  the guard relies on also resumes with the framework's own tools. In-memory copies are kept only
  when asked for, and bounded by size. It has the interface :class:`~stability.adapters.torch.
  TorchGuard` expects of its ``store`` (``entries``, ``save``, ``latest_healthy``, ``restore``,
  ``drop``).
* :func:`params_finite` -- one fused check that no weight is NaN/inf (no checkpoint of bad
  weights is ever written).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .interventions import (
    SavedCheckpoint,
    load_checkpoint,
    retention_victims,
    save_checkpoint,
)

__all__ = ["TrainerCheckpointStore", "params_finite", "state_bytes"]

#: ``loader(path, model, optimizer, scheduler)`` restores a trainer checkpoint in place.
Loader = Callable[[str, Any, Any, Any], None]
#: ``writer(step, healthy, reason)`` writes a trainer checkpoint now and returns its path.
Writer = Callable[[int, bool, str], str]


def state_bytes(obj: Any) -> int:
    """Bytes held by the tensors of a (nested) state dict, without copying anything."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def params_finite(params: Iterable[torch.Tensor]) -> bool:
    """``True`` when no parameter holds a NaN or an infinity (one fused reduction, one sync)."""
    ps = [p.detach() for p in params]
    if not ps:
        return True
    norms = torch._foreach_norm(ps)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


class TrainerCheckpointStore:
    """Rollback checkpoints held by the trainer (files / directories) or, if asked, in memory.

    Parameters
    ----------
    loader : callable
        ``loader(path, model, optimizer, scheduler)`` restores one of the trainer's checkpoints.
    writer : callable, optional
        ``writer(step, healthy, reason) -> path`` writes a trainer checkpoint now (Lightning's
        ``trainer.save_checkpoint``). Without one, :meth:`save` keeps in-memory copies, and only
        if ``memory_limit_bytes`` allows it.
    keep : int
        Periodic checkpoints kept by :meth:`save` (older ones written by the writer are deleted;
        the newest healthy one is always kept). Checkpoints registered with :meth:`add` belong
        to the trainer and are never deleted here.
    memory_limit_bytes : int
        Budget for in-memory copies (0 = none are ever taken). A copy larger than the budget is
        refused with ``ValueError`` (the guard logs it and goes on); older copies are evicted to
        make room.
    """

    def __init__(self, loader: Loader, writer: Writer | None = None, *, keep: int = 2,
                 memory_limit_bytes: int = 0) -> None:
        if keep < 1:
            raise ValueError("The 'keep' parameter of TrainerCheckpointStore must be an int in "
                             f"the range [1, inf). Got {keep} instead.")
        if memory_limit_bytes < 0:
            raise ValueError("The 'memory_limit_bytes' parameter of TrainerCheckpointStore must "
                             f"be >= 0. Got {memory_limit_bytes} instead.")
        self.loader = loader
        self.writer = writer
        self.keep = int(keep)
        self.memory_limit_bytes = int(memory_limit_bytes)
        self._entries: dict[int, SavedCheckpoint] = {}
        self._owned: set[int] = set()          # written by save(): pruned by keep
        self._memory: dict[int, dict[str, Any]] = {}
        self._memory_bytes: dict[int, int] = {}
        self.on_drop: Any = None               # on_drop(step) after a checkpoint is forgotten

    # ------------------------------------------------------------------ bookkeeping
    @property
    def entries(self) -> dict[int, SavedCheckpoint]:
        """Usable checkpoints by guard step (those whose file or directory is gone are left out:
        the trainer's own rotation may delete them)."""
        gone = [s for s, e in self._entries.items()
                if e.path is not None and not os.path.exists(e.path)]
        for s in gone:
            self._entries.pop(s)
            self._owned.discard(s)
        return dict(self._entries)

    def add(self, step: int, path: str, *, healthy: bool, reason: str = "",
            owned: bool = False) -> SavedCheckpoint:
        """Register a checkpoint the trainer wrote (covering guard step ``step``).

        ``owned`` ones were written for the guard: only ``keep`` of them are kept (older files
        are deleted); the others belong to the trainer's own schedule and rotation.
        """
        entry = SavedCheckpoint(int(step), 0, bool(healthy), reason, str(path))
        self._entries[int(step)] = entry
        if owned:
            self._owned.add(int(step))
            self._prune()
        return entry

    def memory_bytes(self) -> int:
        """Bytes held by in-memory copies."""
        return sum(self._memory_bytes.values())

    # ------------------------------------------------------------------ the guard's interface
    def save(self, model: Any, optimizer: Any, scheduler: Any, *, step: int,
             data_position: int, healthy: bool, reason: str = "",
             monitor_state: Mapping[str, Any] | None = None,
             protect: Iterable[int] = ()) -> SavedCheckpoint:
        """Take a checkpoint now: through the trainer's writer, else in memory (if allowed).

        ``protect``: steps retention must not delete now (the rollback target of an open
        episode).
        """
        protect = set(protect)
        if self.writer is not None:
            path = self.writer(int(step), bool(healthy), reason)
            entry = SavedCheckpoint(int(step), int(data_position), bool(healthy), reason, path)
            self._entries[int(step)] = entry
            self._owned.add(int(step))
            self._prune(protect)
            return entry
        need = state_bytes(model.state_dict()) + (
            0 if optimizer is None else state_bytes(optimizer.state_dict()))
        if need > self.memory_limit_bytes:
            raise ValueError(
                f"an in-memory checkpoint needs {need / 2**20:.1f} MiB, over the "
                f"{self.memory_limit_bytes / 2**20:.1f} MiB allowed (memory_limit_mb); "
                "use the trainer's checkpoints instead")
        while self._memory and self.memory_bytes() + need > self.memory_limit_bytes:
            victims = [s for s in sorted(self._memory) if s not in protect] or sorted(self._memory)
            self.drop(victims[0])
        snap = save_checkpoint(None, model, optimizer, scheduler, step=step,
                               data_position=data_position, healthy=healthy, reason=reason)
        self._memory[int(step)] = snap
        self._memory_bytes[int(step)] = need
        entry = SavedCheckpoint(int(step), int(data_position), bool(healthy), reason, None)
        self._entries[int(step)] = entry
        return entry

    def _prune(self, protect: Iterable[int] = ()) -> None:
        # the CheckpointStore rule, over the checkpoints this store wrote (the trainer's own
        # rotation handles the rest)
        owned = {s: self._entries[s] for s in self._owned if s in self._entries}
        for s in retention_victims(owned, self.keep, protect):
            self.drop(s)

    def drop(self, step: int) -> None:
        """Forget the checkpoint of ``step`` (deleting it only if this store wrote it)."""
        entry = self._entries.pop(step, None)
        self._memory.pop(step, None)
        self._memory_bytes.pop(step, None)
        if step in self._owned:
            self._owned.discard(step)
            if entry is not None and entry.path and os.path.isfile(entry.path):
                os.unlink(entry.path)
        if entry is not None and self.on_drop is not None:
            try:
                self.on_drop(step)
            except Exception:  # bookkeeping must never kill the run
                pass

    def latest_healthy(self, at_or_before: int | None = None) -> SavedCheckpoint | None:
        """Newest usable healthy checkpoint at or before a step (``None`` if there is none)."""
        cands = [e for s, e in self.entries.items() if e.healthy
                 and (at_or_before is None or s <= at_or_before)]
        return max(cands, key=lambda e: e.step) if cands else None

    def restore(self, step: int, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """Restore the checkpoint of ``step`` in place; returns ``{"data_position": ...}``."""
        entry = self.entries.get(step)
        if entry is None:
            raise KeyError(f"No checkpoint for step {step}; have {sorted(self._entries)}")
        if entry.path is None:
            return load_checkpoint(self._memory[step], model, optimizer, scheduler)
        self.loader(entry.path, model, optimizer, scheduler)
        return {"data_position": entry.data_position}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The trainer checkpoints known (JSON data; in-memory copies do not survive a resume)."""
        return {"version": 1, "entries": [
            {"step": e.step, "path": e.path, "healthy": e.healthy, "reason": e.reason,
             "owned": s in self._owned}
            for s, e in sorted(self._entries.items()) if e.path is not None]}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (entries whose file is gone are dropped on use)."""
        self._entries, self._owned = {}, set()
        self._memory, self._memory_bytes = {}, {}
        for e in sd.get("entries", []):
            s = int(e["step"])
            self._entries[s] = SavedCheckpoint(s, 0, bool(e.get("healthy", True)),
                                               str(e.get("reason", "")), str(e["path"]))
            if e.get("owned"):
                self._owned.add(s)


def last_step_feedback(guard: Any, last_lr: float, last_factor: float) -> dict[str, float]:
    """:meth:`TorchGuard.metrics` with the LR and factor of the *last* optimizer step.

    Trainers log after the step: ``stability/lr_base`` / ``lr_factor`` / ``lr_effective`` refer
    to the step just taken (what the trainer's own ``learning_rate`` refers to), and
    ``stability/step`` is the guard's step.  Empty before the guard exists.
    """
    if guard is None:
        return {}
    out: dict[str, float] = guard.metrics()
    out["stability/lr_factor"] = float(last_factor)
    out["stability/lr_base"] = float(last_lr)
    out["stability/lr_effective"] = float(last_lr * last_factor)
    out["stability/step"] = float(guard.step_count)
    return out


def finish_deferring_emergency(guard: Any) -> tuple[Any, bool, bool]:
    """``guard.finish()`` with the emergency checkpoint left to the trainer's own save.

    Returns ``(control, emergency, rolled_back)``: the step's control as decided, whether it
    asked for an emergency checkpoint (the caller writes it through the trainer, and only if the
    weights are fine), and whether ``finish`` rolled back.
    """
    ctl = guard.control
    emergency = bool(ctl.save_checkpoint)
    if emergency:
        guard.control = dataclasses.replace(ctl, save_checkpoint=False)
    before = guard.rollbacks
    guard.finish()
    return ctl, emergency, guard.rollbacks > before
