"""Checkpoints of a plain PyTorch run: atomic files, safe loading, retention.

* :func:`save_checkpoint` / :func:`load_checkpoint` -- atomic ``torch.save`` of model, optimizer,
  scheduler, monitor state and data position; :class:`CheckpointStore` keeps them on disk or in
  memory and knows which were healthy (:func:`retention_victims` decides what is deleted).
* :func:`safe_torch_load` -- ``torch.load`` with ``weights_only=True``.

Everything here is also importable from :mod:`stability.adapters.interventions`.  torch is
imported at module level: this module is only imported through ``stability.adapters`` entry
points that are documented to need torch.
"""

from __future__ import annotations

import copy
import json
import logging
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
    "SavedCheckpoint",
    "load_checkpoint",
    "retention_victims",
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
