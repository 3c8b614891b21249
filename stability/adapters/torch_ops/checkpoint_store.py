"""Checkpoints of a plain PyTorch run: atomic files, safe loading, retention.

* :func:`save_checkpoint` / :func:`load_checkpoint` -- atomic ``torch.save`` of model, optimizer,
  scheduler, monitor state and data position; :class:`CheckpointStore` keeps them on disk or in
  memory.  It does the file IO only: the registry is a
  :class:`~stability.run.checkpoints.CheckpointLedger` (the monitor's, or the store's own), which
  decides what exists, what is healthy, what retention deletes and what a rollback restores
  (:class:`LedgerStore` is the part shared with the HF / Lightning trainer stores).
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
from pathlib import Path
from typing import Any

import torch

from stability.run.checkpoints import (
    MEMORY_PREFIX,
    CheckpointLedger,
    CheckpointRecord,
    keep_last_plan,
)

log = logging.getLogger("stability.adapters")

__all__ = [
    "CheckpointStore",
    "LedgerStore",
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


#: The records of :class:`CheckpointStore` are the ledger's (the old name, kept for imports).
SavedCheckpoint = CheckpointRecord


def retention_victims(entries: Mapping[int, CheckpointRecord], keep: int,
                      protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete: all but the ``keep`` newest healthy checkpoints, the newest emergency
    (unhealthy) one and the ``protect`` ones (:func:`stability.run.checkpoints.keep_last_plan`, the
    rule :meth:`CheckpointLedger.prune` applies).

    >>> e = {s: CheckpointRecord(s, f"c{s}", s != 30) for s in (10, 20, 30, 40)}
    >>> retention_victims(e, keep=1), retention_victims(e, keep=1, protect={10})
    ([10, 20], [20])
    """
    return keep_last_plan(entries.values(), keep, protect)


class LedgerStore:
    """File IO under a :class:`~stability.run.checkpoints.CheckpointLedger`: the shared half of
    :class:`CheckpointStore` and the trainer stores.

    The ledger is the registry (what exists, what is healthy, what retention drops, what a
    rollback restores); the store holds the bytes (files it wrote, in-memory copies) and is the
    ledger's :class:`~stability.run.checkpoints.CheckpointFiles`: it deletes what the ledger drops
    and tells it which checkpoints are still there.  Without a ledger the store makes its own.
    """

    def __init__(self, ledger: CheckpointLedger | None = None, on_drop: Any = None) -> None:
        self.owns_ledger = ledger is None
        self.ledger: CheckpointLedger = CheckpointLedger() if ledger is None else ledger
        self.ledger.attach(self)
        self._memory: dict[int, dict[str, Any]] = {}
        self.on_drop = on_drop  # on_drop(step) after a checkpoint left the ledger

    # ------------------------------------------------------------------ the ledger
    def bind(self, ledger: CheckpointLedger) -> None:
        """Use ``ledger`` (e.g. the monitor's) from now on; records of this store's previous
        ledger that ``ledger`` lacks are carried over (nothing is deleted)."""
        if ledger is self.ledger:
            ledger.attach(self)
            return
        old = self.ledger
        old.detach(self)
        have = {r.step for r in ledger.records}
        ledger.attach(self)
        for r in old.records:
            if r.step not in have:
                ledger.add(r.step, r.path, r.healthy, r.reason, r.covers_step,
                           data_position=r.data_position, managed=r.managed)
        self.ledger, self.owns_ledger = ledger, False

    def unbind(self) -> None:
        """Stop doing the IO of the ledger (another store takes over)."""
        self.ledger.detach(self)

    @property
    def entries(self) -> dict[int, CheckpointRecord]:
        """The ledger's checkpoints this store can restore, by step (read-only view)."""
        return {r.step: r for r in list(self.ledger.records) if self.exists(r)}

    def latest_healthy(self, at_or_before: int | None = None) -> CheckpointRecord | None:
        """Newest healthy checkpoint (the ledger's judgement) at or before a step."""
        at = 2**62 if at_or_before is None else int(at_or_before)
        return self.ledger.latest_healthy_before(at + 1, 0)

    def _memory_path(self, step: int) -> str:
        return f"{MEMORY_PREFIX}step-{int(step)}"

    # ------------------------------------------------------------------ CheckpointFiles
    def exists(self, rec: CheckpointRecord) -> bool:
        """Whether the checkpoint of ``rec`` can be restored."""
        if rec.in_memory:
            return rec.step in self._memory and rec.path == self._memory_path(rec.step)
        return os.path.exists(rec.path)

    def delete(self, rec: CheckpointRecord) -> None:
        """``rec`` left the ledger: drop its in-memory copy, delete its file if managed."""
        if rec.in_memory:
            self._memory.pop(rec.step, None)
        elif rec.managed:
            self._unlink(rec.path)
        self._dropped(rec)
        if self.on_drop is not None:
            try:
                self.on_drop(rec.step)
            except Exception:  # bookkeeping must never kill the run
                log.debug("on_drop(%s) failed", rec.step, exc_info=True)

    def _unlink(self, path: str) -> None:
        if os.path.isfile(path):
            os.unlink(path)

    def _dropped(self, rec: CheckpointRecord) -> None:
        """Hook for subclasses (the on-disk index)."""

    # ------------------------------------------------------------------ the store's half
    def drop(self, step: int) -> None:
        """Forget the checkpoint of ``step`` (the ledger record; the file if managed)."""
        self.ledger.forget(step)

    def prune(self, keep: int, protect: Iterable[int] = (), margin: int | None = None) -> None:
        """The ledger's keep-last retention (:meth:`CheckpointLedger.prune`) over what this
        store wrote; the files go with their records."""
        self.ledger.prune(keep, protect, margin)

    def reconcile(self) -> list[CheckpointRecord]:
        """After a resume: drop (with a warning) the ledger records whose checkpoint is gone
        (in-memory copies never survive a restart); returns them."""
        return self.ledger.verify()

    def restore_record(self, rec: CheckpointRecord, model: Any, optimizer: Any,
                       scheduler: Any) -> dict[str, Any]:
        """Load ``rec``'s checkpoint in place (subclasses add file formats)."""
        return load_checkpoint(self._memory[rec.step], model, optimizer, scheduler)

    def restore(self, step: int, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        """Load the checkpoint of ``step`` in place; returns its snapshot.

        ``KeyError`` when the ledger has no restorable checkpoint of ``step``.
        """
        rec = self.ledger.get(step)
        if rec is None:
            raise KeyError(f"No checkpoint for step {step}; have {sorted(self.entries)}")
        return self.restore_record(rec, model, optimizer, scheduler)

    def state_dict(self) -> dict[str, Any]:
        """JSON data: the ledger's state when the store owns it (else the owner saves it)."""
        return {"version": 2, "ledger": self.ledger.state_dict() if self.owns_ledger else None}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output, then :meth:`reconcile` with what is on disk.

        Version 1 snapshots (a list of ``entries``) are registered in the ledger if it lacks
        them.
        """
        led = sd.get("ledger")
        if led is not None and self.owns_ledger:
            self.ledger.load_state_dict(led)
        have = {r.step for r in self.ledger.records}
        for e in sd.get("entries", []) or []:  # version 1
            if e.get("path") is not None and int(e["step"]) not in have:
                self.ledger.add(int(e["step"]), str(e["path"]), bool(e.get("healthy", True)),
                                str(e.get("reason", "")), int(e["step"]),
                                data_position=int(e.get("data_position", 0)),
                                managed=bool(e.get("owned", e.get("managed", False))))
        self.reconcile()


class CheckpointStore(LedgerStore):
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
    ledger : CheckpointLedger, optional
        The registry (the monitor's ``Monitor.checkpoints``); default: the store's own.
    on_drop : callable, optional
        ``on_drop(step)`` after a checkpoint left the ledger (and its file was deleted).

    On disk, an index (``index[-rank<r>].json``, JSON data, written atomically after every save
    and delete) lists the checkpoints of the directory with their health flags. A store with
    its own ledger registers the indexed checkpoints whose file is still there when it is
    created; a store on a shared ledger does so in :meth:`reconcile` (the guard calls it on
    resume).
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, keep: int = 4, rank: int = -1,
        on_drop: Any = None, ledger: CheckpointLedger | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"The 'keep' parameter of CheckpointStore must be >= 1. Got {keep}.")
        self.directory = None if directory is None else Path(directory)
        self.keep = int(keep)
        self.rank = int(rank)
        super().__init__(ledger, on_drop)
        if self.owns_ledger:
            self._adopt_index()

    # ------------------------------------------------------------------ on-disk index
    def _index_path(self) -> Path | None:
        if self.directory is None:
            return None
        suffix = "" if self.rank < 0 else f"-rank{self.rank}"
        return self.directory / f"index{suffix}.json"

    def _read_index(self) -> list[CheckpointRecord]:
        """The index's records whose file is there (``[]`` without a readable index)."""
        path = self._index_path()
        if path is None or not path.is_file():
            return []
        assert self.directory is not None
        out = []
        try:
            for r in json.loads(path.read_text())["entries"]:
                f = self.directory / str(r["file"])
                if f.is_file():
                    step = int(r["step"])
                    out.append(CheckpointRecord(
                        step, str(f), bool(r["healthy"]), str(r["reason"]),
                        int(r.get("covers_step", step)), int(r["data_position"]),
                        bool(r.get("managed", True))))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a bad index: ignore it
            log.warning("checkpoint index %s unreadable (%s: %s); ignoring it", path,
                        type(exc).__name__, exc)
            return []
        return out

    def _adopt_index(self, rows: list[CheckpointRecord] | None = None) -> None:
        """Register the indexed checkpoints (file present) that the ledger lacks."""
        have = {r.step for r in self.ledger.records}
        for r in self._read_index() if rows is None else rows:
            if r.step not in have:
                self.ledger.add(r.step, r.path, r.healthy, r.reason, r.covers_step,
                                data_position=r.data_position, managed=r.managed)

    def _mine(self, rec: CheckpointRecord) -> bool:
        return (self.directory is not None and not rec.in_memory
                and Path(rec.path).parent == self.directory)

    def _write_index(self) -> None:
        path = self._index_path()
        if path is None:
            return
        rows = [{"step": r.step, "data_position": r.data_position, "healthy": r.healthy,
                 "reason": r.reason, "file": Path(r.path).name, "covers_step": r.covers,
                 "managed": r.managed}
                for r in sorted(self.ledger.records, key=lambda r: r.step) if self._mine(r)]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 2, "entries": rows}))
            os.replace(tmp, path)
        except OSError as exc:  # the checkpoints themselves are fine; the next save retries
            log.debug("could not write the checkpoint index %s: %s", path, exc)

    def _dropped(self, rec: CheckpointRecord) -> None:
        if self._mine(rec):
            self._write_index()

    def reconcile(self) -> list[CheckpointRecord]:
        """After a resume: drop (with a warning) the ledger's records whose checkpoint is gone,
        register the indexed files the ledger lacks (saved after its snapshot was taken), and
        rewrite the index; returns the dropped records."""
        rows = self._read_index()  # before a drop rewrites the index
        gone = super().reconcile()
        self._adopt_index(rows)
        self._write_index()
        return gone

    # ------------------------------------------------------------------ saving
    def _path(self, step: int) -> Path | None:
        if self.directory is None:
            return None
        suffix = "" if self.rank < 0 else f"-rank{self.rank}"
        return self.directory / f"step-{step:09d}{suffix}.pt"

    def save(self, model: torch.nn.Module, optimizer: Any, scheduler: Any, *, step: int,
             data_position: int, healthy: bool, reason: str = "",
             monitor_state: Mapping[str, Any] | None = None,
             protect: Iterable[int] = (), margin: int | None = None) -> CheckpointRecord:
        """Take a checkpoint, register it in the ledger, prune; returns its record.

        ``protect``: steps whose checkpoints retention must not delete now; ``margin``: the
        alarm margin retention judges health with (the policy's ``checkpoint_margin``).
        """
        path = self._path(step)
        snap = save_checkpoint(path, model, optimizer, scheduler, step=step,
                               data_position=data_position, monitor_state=monitor_state,
                               healthy=healthy, reason=reason)
        if path is None:
            self._memory[int(step)] = snap
        rec = self.ledger.add(step, self._memory_path(step) if path is None else str(path),
                              healthy, reason, step, data_position=data_position, managed=True)
        self.prune(self.keep, protect, margin)
        self._write_index()
        return rec

    def restore_record(self, rec: CheckpointRecord, model: Any, optimizer: Any,
                       scheduler: Any) -> dict[str, Any]:
        source: Any = self._memory[rec.step] if rec.in_memory else rec.path
        return load_checkpoint(source, model, optimizer, scheduler)
