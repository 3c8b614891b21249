"""Pieces shared by the HF Transformers and Lightning callbacks.

* :class:`TrainerCheckpointStore` -- the guard's rollback source when a *trainer* writes the
  checkpoints: entries point at the trainer's own checkpoints (an HF ``checkpoint-N`` directory, a
  Lightning ``.ckpt`` file), restored in place by a trainer-specific loader, so every checkpoint
  the guard relies on also resumes with the framework's own tools. In-memory copies are kept only
  when asked for, and bounded by size. Like :class:`~stability.adapters.torch_ops.checkpoint_store.
  CheckpointStore` it keeps no registry of its own: the records live in the monitor's
  :class:`~stability.run.checkpoints.CheckpointLedger`.
* :func:`params_finite` -- one fused check that no weight is NaN/inf (no checkpoint of bad
  weights is ever written).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from stability.adapters.torch_ops.checkpoint_store import (
    LedgerStore,
    load_checkpoint,
    save_checkpoint,
)
from stability.adapters.torch_ops.sharded import all_finite
from stability.run.checkpoints import CheckpointLedger, CheckpointRecord

__all__ = ["TrainerCheckpointStore", "params_finite", "state_bytes"]

log = logging.getLogger("stability.adapters")

#: ``loader(path, model, optimizer, scheduler, scaler=None)`` restores a trainer checkpoint in
#: place: all of it or nothing (``RestoreRefused``).
Loader = Callable[..., None]
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
    """``True`` when no parameter holds a NaN or an infinity (one fused reduction, one sync;
    sharded ``DTensor`` parameters: every rank's shards, all-reduced -- call it on every rank;
    :func:`~stability.adapters.torch_ops.sharded.all_finite`)."""
    return all_finite(params)


class TrainerCheckpointStore(LedgerStore):
    """Rollback checkpoints held by the trainer (files / directories) or, if asked, in memory.

    The registry is a :class:`~stability.run.checkpoints.CheckpointLedger` (the monitor's once the
    callback binds it, see :meth:`LedgerStore.bind`): this store registers the trainer's
    checkpoints in it and does the IO (restore through ``loader``, delete what retention drops).

    Parameters
    ----------
    loader : callable
        ``loader(path, model, optimizer, scheduler)`` restores one of the trainer's checkpoints.
    writer : callable, optional
        ``writer(step, healthy, reason) -> path`` writes a trainer checkpoint now (Lightning's
        ``trainer.save_checkpoint``). Without one, :meth:`save` keeps in-memory copies, and only
        if ``memory_limit_bytes`` allows it.
    keep : int
        Periodic checkpoints kept (older ones this store wrote or registered as ``owned`` are
        deleted; the newest healthy one is always kept). Checkpoints registered with :meth:`add`
        without ``owned`` belong to the trainer and are never deleted here (only forgotten once
        the trainer's rotation removed them).
    memory_limit_bytes : int
        Budget for in-memory copies (0 = none are ever taken). A copy larger than the budget is
        refused with ``ValueError`` (the guard logs it and goes on); older copies are evicted to
        make room.
    ledger : CheckpointLedger, optional
        The registry; default: the store's own (until :meth:`bind`).
    """

    def __init__(self, loader: Loader, writer: Writer | None = None, *, keep: int = 2,
                 memory_limit_bytes: int = 0, ledger: CheckpointLedger | None = None) -> None:
        if keep < 1:
            raise ValueError("The 'keep' parameter of TrainerCheckpointStore must be an int in "
                             f"the range [1, inf). Got {keep} instead.")
        if memory_limit_bytes < 0:
            raise ValueError("The 'memory_limit_bytes' parameter of TrainerCheckpointStore must "
                             f"be >= 0. Got {memory_limit_bytes} instead.")
        super().__init__(ledger)
        self.loader = loader
        self.writer = writer
        self.keep = int(keep)
        self.memory_limit_bytes = int(memory_limit_bytes)
        self._memory_bytes: dict[int, int] = {}

    # ------------------------------------------------------------------ bookkeeping
    def add(self, step: int, path: str, *, healthy: bool, reason: str = "",
            owned: bool = False, data_position: int = 0,
            protect: Iterable[int] = ()) -> CheckpointRecord:
        """Register a checkpoint the trainer wrote (covering guard step ``step``).

        ``owned`` ones were written for the guard: only ``keep`` of them are kept (older files
        are deleted, never the steps in ``protect``: rollback targets the policy may still
        need); the others belong to the trainer's own schedule and rotation.
        """
        rec = self.ledger.add(step, str(path), healthy, reason, step,
                              data_position=data_position, managed=owned)
        if owned:
            self.prune(self.keep, protect)
        return rec

    def forget_rotated(self) -> list[CheckpointRecord]:
        """Forget the trainer checkpoints its own rotation deleted (logged at INFO: expected)."""
        gone = [r for r in list(self.ledger.records) if not r.in_memory and not r.managed
                and not os.path.exists(r.path)]
        for r in gone:
            log.info("trainer checkpoint of step %d (%s) was rotated away: forgotten",
                     r.step, r.path)
            self.ledger.forget(r.step)
        return gone

    def memory_bytes(self) -> int:
        """Bytes held by in-memory copies."""
        return sum(self._memory_bytes.values())

    def delete(self, rec: CheckpointRecord) -> None:
        self._memory_bytes.pop(rec.step, None)
        super().delete(rec)

    # ------------------------------------------------------------------ the guard's interface
    def save(self, model: Any, optimizer: Any, scheduler: Any, *, step: int,
             data_position: int, healthy: bool, reason: str = "",
             monitor_state: Mapping[str, Any] | None = None,
             protect: Iterable[int] = (), margin: int | None = None,
             scaler: Any = None) -> CheckpointRecord:
        """Take a checkpoint now: through the trainer's writer, else in memory (if allowed).

        ``protect``: steps retention must not delete now (the rollback target of an open
        episode); ``margin``: the alarm margin retention judges health with.
        """
        protect = set(protect)
        if self.writer is not None:
            path = self.writer(int(step), bool(healthy), reason)
            rec = self.ledger.add(step, path, healthy, reason, step,
                                  data_position=data_position, managed=True)
            self.prune(self.keep, protect, margin)
            return rec
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
            self._memory.pop(victims[0], None)  # (a copy the ledger no longer listed)
            self._memory_bytes.pop(victims[0], None)
        snap = save_checkpoint(None, model, optimizer, scheduler, step=step,
                               data_position=data_position, healthy=healthy, reason=reason,
                               scaler=scaler)
        self._memory[int(step)] = snap
        self._memory_bytes[int(step)] = need
        return self.ledger.add(step, self._memory_path(step), healthy, reason, step,
                               data_position=data_position, managed=True)

    def restore_record(self, rec: CheckpointRecord, model: Any, optimizer: Any,
                       scheduler: Any, scaler: Any = None) -> dict[str, Any]:
        """Restore ``rec`` in place (all of it or nothing); returns the snapshot
        (``{"data_position": ...}`` for a trainer checkpoint)."""
        if rec.in_memory:
            return load_checkpoint(self._memory[rec.step], model, optimizer, scheduler, scaler)
        if scaler is None:
            self.loader(rec.path, model, optimizer, scheduler)
        else:
            self.loader(rec.path, model, optimizer, scheduler, scaler=scaler)
        return {"data_position": rec.data_position}


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
    if not math.isnan(last_lr):  # no step yet: missing, never NaN (see outputs.feedback)
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
    guard.finish()
    return ctl, emergency, guard.rolled_back
