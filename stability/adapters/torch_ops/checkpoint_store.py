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
import errno
import json
import logging
import os
import re
import socket
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from stability.adapters.torch_ops.sharded import agree, is_sharded, local_state, shard_like
from stability.run.checkpoints import (
    MEMORY_PREFIX,
    CheckpointLedger,
    CheckpointRecord,
    keep_last_plan,
)

log = logging.getLogger("stability.adapters")

__all__ = [
    "CheckpointDirectory",
    "CheckpointDirectoryBusy",
    "CheckpointStore",
    "LedgerStore",
    "RestoreRefused",
    "SavedCheckpoint",
    "load_checkpoint",
    "restore_state",
    "retention_victims",
    "safe_torch_load",
    "save_checkpoint",
    "verify_loadable",
    "weights_only_safe",
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


#: leaf types ``torch.load(weights_only=True)`` accepts as they are
_SAFE_LEAVES = (torch.Tensor, str, bytes, bytearray, int, float, complex, bool, type(None),
                torch.Size, torch.dtype, torch.device)


def _safe_leaf(x: Any) -> Any:
    """A form of a non-container ``x`` the safe loader accepts (plain data, never code)."""
    import enum

    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if isinstance(x, enum.Enum):
        return _safe_leaf(x.value)
    item = getattr(x, "item", None)  # NumPy scalars and 0-d arrays
    if type(x).__module__ == "numpy":
        try:
            if getattr(x, "ndim", 0) == 0 and item is not None:
                return item()
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            return repr(x)
    if isinstance(x, type) or callable(x):
        return f"{getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x))}"
    return repr(x)


def weights_only_safe(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """``obj`` in a form ``torch.load(weights_only=True)`` accepts, and what was converted.

    Tensors, numbers, strings and containers of them stay as they are; a mapping subclass
    becomes a ``dict``, an ``argparse.Namespace`` the ``dict`` of its attributes, a path its
    string, a NumPy scalar a Python number (an array a tensor), an enum its value, a class or
    function its dotted name, anything else its ``repr``.  Returns ``(safe, converted)``
    with ``converted`` the dotted keys and type names of what changed.

    >>> import argparse, pathlib
    >>> weights_only_safe({"a": argparse.Namespace(p=pathlib.Path("/x")), "n": 1})
    ({'a': {'p': '/x'}, 'n': 1}, ['a (Namespace)', 'a.p (PosixPath)'])
    """
    out: list[str] = []
    return _make_safe(obj, where, out), out


def _make_safe(x: Any, where: str, out: list[str]) -> Any:
    if type(x) in _SAFE_LEAVES or isinstance(x, torch.Tensor):
        return x
    import argparse

    if isinstance(x, argparse.Namespace):
        out.append(f"{where} (Namespace)")
        x = vars(x)
    if isinstance(x, Mapping):
        if type(x) not in (dict, OrderedDict) and not out[-1:] == [f"{where} (Namespace)"]:
            out.append(f"{where} ({type(x).__name__})")
        items = {_make_safe(k, f"{where}.<key>", out): _make_safe(
            v, f"{where}.{k}" if where else str(k), out) for k, v in x.items()}
        return OrderedDict(items) if type(x) is OrderedDict else items
    if type(x) in (list, tuple, set):
        return type(x)(_make_safe(v, f"{where}[{i}]", out) for i, v in enumerate(x))
    if isinstance(x, (list, tuple)):  # a namedtuple, a list subclass
        out.append(f"{where} ({type(x).__name__})")
        return [_make_safe(v, f"{where}[{i}]", out) for i, v in enumerate(x)]
    if isinstance(x, _SAFE_LEAVES):  # a subclass of int, str, ...: its plain value
        out.append(f"{where} ({type(x).__name__})")
        for base in (bool, int, float, complex, str, bytes):
            if isinstance(x, base):
                plain: Any = base
                return plain(x)
    out.append(f"{where} ({type(x).__name__})")
    return _safe_leaf(x)


def verify_loadable(path: str | os.PathLike[str]) -> str | None:
    """``None`` when ``path`` loads with ``weights_only=True``, else why not.

    The pickle is parsed and the tensor data memory-mapped, not read (``mmap=True``), so
    verifying a checkpoint just written costs milliseconds whatever its size.
    """
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # any reason the safe loader refuses it
        first = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {first[0][:300] if first else ''}"
    return None


# ---------------------------------------------------------------------------- the directory
class CheckpointDirectoryBusy(RuntimeError):
    """Another live process holds this checkpoint directory: two runs sharing it would
    overwrite each other's checkpoints and roll back onto each other's weights."""


#: lock files this process holds: real path -> [fd, number of stores using it]
_HELD_LOCKS: dict[str, list[int]] = {}


def _release_lock(key: str) -> None:
    held = _HELD_LOCKS.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] <= 0:
        del _HELD_LOCKS[key]
        try:
            os.close(held[0])  # closing the descriptor drops the flock
        except OSError:
            pass


class CheckpointDirectory:
    """The directory a checkpoint store owns: its lock, the names it writes, what it may delete.

    Three rules hold for every path the store touches there:

    * **Ownership.** Only a plain name matching ``names`` directly inside the directory, that is
      a regular file (never a symlink), is ever deleted -- whatever an index or a state dict
      says (:meth:`delete`).
    * **One run per directory.** :meth:`acquire` takes an exclusive ``flock`` on the lock file
      ``lock_name`` (one per rank) for the life of the process; a second process on the same
      directory gets :class:`CheckpointDirectoryBusy` naming the holder.  Stores of one process
      share the lock (a resume in the same process is allowed).
    * **Atomic, exclusive writes.** :meth:`write_atomic` writes to a fresh ``O_EXCL`` temporary
      name and renames it over the target (a planted symlink is replaced, never followed);
      temporary files of the store's own names (``<name>.<random>.tmp``, left by a killed
      write) are reaped when the lock is first taken.

    >>> import tempfile
    >>> d = CheckpointDirectory(tempfile.mkdtemp(), r"step-\\d+\\.pt"); d.acquire()
    >>> d.owned_name(d.path / "step-1.pt"), d.owned_name(d.path / ".." / "step-1.pt")
    ('step-1.pt', None)
    >>> d.release()
    """

    def __init__(self, path: str | os.PathLike[str], names: str,
                 lock_name: str = ".stability-lock", tmp_names: str | None = None) -> None:
        self.path = Path(path)
        self.names = re.compile(names)
        self.lock_name = lock_name
        self._tmp = re.compile(rf"(?:{tmp_names or names})\.[A-Za-z0-9_]+\.tmp")
        self._key: str | None = None

    # ------------------------------------------------------------------ the lock
    def acquire(self) -> None:
        """Create the directory, take its lock, reap stale temporary files of the store.

        Raises :class:`CheckpointDirectoryBusy` when another live process holds the lock.  A
        lock file that cannot be created (read-only or full disk) is logged and skipped: the
        saves will report their own failures and training goes on.
        """
        if self._key is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / self.lock_name
        key = os.path.realpath(lock)
        if key in _HELD_LOCKS:
            _HELD_LOCKS[key][1] += 1
            self._key = key
            return
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CheckpointDirectoryBusy(
                    f"{lock} is a symlink: refused (the checkpoint lock is a plain file the "
                    "store creates)") from exc
            log.warning("could not create the checkpoint lock %s (%s); going on without it",
                        lock, exc)
            return
        self._lock_fd(fd, lock)
        _HELD_LOCKS[key] = [fd, 1]
        self._key = key
        self.reap_tmp()

    def _lock_fd(self, fd: int, lock: Path) -> None:
        """``flock`` the lock file and write who holds it (else close it and raise)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no flock on this platform
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointDirectoryBusy(f"{lock} is not a regular file: refused")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = self._holder(fd)
            os.close(fd)
            raise CheckpointDirectoryBusy(
                f"checkpoint directory {self.path} is in use by another run ({holder}); two "
                "runs sharing one checkpoint_dir would overwrite each other's checkpoints and "
                "roll back onto each other's weights. Give each run its own checkpoint_dir."
            ) from exc
        except BaseException:
            os.close(fd)
            raise
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": time.time()}).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me, 0)
        except OSError:  # who holds it is only for the message
            pass

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"{}")
            return f"pid {int(info['pid'])} on {str(info['host'])[:64]}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        """Drop this store's hold on the lock (the last store of the process unlocks)."""
        key, self._key = self._key, None
        if key is not None:
            _release_lock(key)

    # ------------------------------------------------------------------ names
    def owned_name(self, path: str | os.PathLike[str]) -> str | None:
        """The plain name of ``path`` if it is one of the store's names directly inside the
        directory (after resolving ``..`` and symlinked parents), else ``None``."""
        p = Path(path)
        if not self.names.fullmatch(p.name):
            return None
        try:
            same = os.path.realpath(p.parent) == os.path.realpath(self.path)
        except (OSError, ValueError):
            return None
        return p.name if same else None

    def delete(self, path: str | os.PathLike[str]) -> bool:
        """Delete ``path`` if the store owns it (:meth:`owned_name`, a regular file, not a
        symlink); ``True`` when it is gone, ``False`` when refused."""
        name = self.owned_name(path)
        if name is None:
            return False
        return self._unlink_regular(name)

    def _unlink_regular(self, name: str) -> bool:
        try:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("could not delete %s/%s: %s", self.path, name, exc)
            return False
        finally:
            os.close(dfd)
        return True

    def reap_tmp(self) -> list[str]:
        """Delete the store's own temporary files (``<name>.<random>.tmp``) left by a killed
        write; returns their names.  Only called while this process holds the lock."""
        try:
            names = [n for n in os.listdir(self.path) if self._tmp.fullmatch(n)]
        except OSError:
            return []
        gone = [n for n in names if self._unlink_regular(n)]
        if gone:
            log.info("reaped %d stale temporary checkpoint file(s) in %s", len(gone), self.path)
        return gone

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write ``data`` to ``name`` in the directory: a fresh ``O_EXCL`` temporary file,
        fsynced, renamed over the target (a symlink there is replaced, never followed)."""
        fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise


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
    scaler: Any = None,
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
    scaler : torch.amp.GradScaler, optional
        The loss scaler of an fp16 run: its scale and growth tracker are saved too, so a
        rollback restores the scale the weights were trained with.

    Returns
    -------
    dict
        The snapshot (``"model"``, ``"optimizer"``, ``"scheduler"``, ``"scaler"``,
        ``"monitor"``, ``"step"``, ``"data_position"``, ``"healthy"``, ``"reason"``,
        ``"extra"``, ``"version"``).
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
        "scaler": None if scaler is None else scaler.state_dict(),
        "monitor": None if monitor_state is None else dict(monitor_state),
        "extra": dict(extra or {}),
        "rng": torch.get_rng_state(),
    }
    if is_sharded(model.parameters()):  # this rank's shards, as plain tensors
        snap["model"], snap["optimizer"] = local_state(snap["model"]), local_state(
            snap["optimizer"])
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


class RestoreRefused(ValueError):
    """A checkpoint cannot be restored into these objects; nothing was changed."""


def _check_weights(model: torch.nn.Module, sd: Any, where: str, sharded: bool = False) -> None:
    """The checkpoint's weights fit ``model`` exactly (keys, shapes) and are all finite
    (``sharded``: this rank's shards, against the model's local shards)."""
    if not isinstance(sd, Mapping):
        raise RestoreRefused(f"{where}: the model state is a {type(sd).__name__}, not a mapping")
    own = local_state(model.state_dict()) if sharded else model.state_dict()
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or extra:
        raise RestoreRefused(f"{where} does not match the model: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise RestoreRefused(f"{where}: {k} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != tuple(own[k].shape):
            raise RestoreRefused(f"{where}: {k} has shape {tuple(t.shape)}, the model's is "
                                 f"{tuple(own[k].shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RestoreRefused(f"{where}: {k} holds non-finite values (a damaged checkpoint "
                                 "is never restored)")


def _check_optimizer(optimizer: Any, sd: Any, where: str) -> None:
    """The optimizer state fits ``optimizer``: same groups, same number of params in each."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("param_groups"), list):
        raise RestoreRefused(f"{where}: the optimizer state has no param_groups list")
    mine = optimizer.param_groups
    theirs = sd["param_groups"]
    if len(theirs) != len(mine) or any(
            not isinstance(g, Mapping) or len(g.get("params", ())) != len(m["params"])
            for g, m in zip(theirs, mine, strict=True)):
        raise RestoreRefused(f"{where}: the optimizer state does not match the optimizer's "
                             "parameter groups")
    if not isinstance(sd.get("state", {}), Mapping):
        raise RestoreRefused(f"{where}: the optimizer's 'state' is not a mapping")


def restore_state(model: torch.nn.Module, model_sd: Any, optimizer: Any = None,
                  optimizer_sd: Any = None, scheduler: Any = None, scheduler_sd: Any = None,
                  scaler: Any = None, scaler_sd: Any = None, *, where: str = "checkpoint"
                  ) -> None:
    """Restore weights, optimizer, scheduler and loss scaler together, or nothing at all.

    Every part is checked first -- weights match the model (keys, shapes) and are finite, the
    optimizer state matches its parameter groups, scheduler and scaler states are mappings --
    and :class:`RestoreRefused` is raised before anything changes.  Parts whose state or
    object is ``None`` are left as they are.

    A sharded model (``DTensor`` parameters, FSDP2): the states hold this rank's local shards
    (as :func:`save_checkpoint` writes them); the checks run on every rank and their verdict
    is all-reduced, so every rank restores or every rank refuses (call it on every rank).
    """
    sharded = is_sharded(model.parameters())
    try:
        _check_parts(model, model_sd, optimizer, optimizer_sd, scheduler, scheduler_sd,
                     scaler, scaler_sd, where, sharded)
    except RestoreRefused:
        if sharded:
            agree(False)
        raise
    if sharded and not agree(True):
        raise RestoreRefused(f"{where}: another rank refused its shard of this checkpoint")
    params = [] if optimizer is None else [p for g in optimizer.param_groups
                                           for p in g["params"]]
    if sharded:
        model_sd = shard_like(model_sd, model.state_dict())[0]
    model.load_state_dict(model_sd)
    if optimizer is not None and optimizer_sd is not None:
        osd = _cpu_copy(optimizer_sd)
        optimizer.load_state_dict(shard_like({}, {}, osd, params)[1] if sharded else osd)
    if scheduler is not None and scheduler_sd is not None:
        scheduler.load_state_dict(copy.deepcopy(scheduler_sd))
    if scaler is not None and scaler_sd:
        scaler.load_state_dict(dict(scaler_sd))


def _check_parts(model: torch.nn.Module, model_sd: Any, optimizer: Any, optimizer_sd: Any,
                 scheduler: Any, scheduler_sd: Any, scaler: Any, scaler_sd: Any, where: str,
                 sharded: bool) -> None:
    """Every check of :func:`restore_state` (:class:`RestoreRefused`); changes nothing."""
    _check_weights(model, model_sd, where, sharded)
    if optimizer is not None and optimizer_sd is not None:
        _check_optimizer(optimizer, optimizer_sd, where)
    for name, obj, sd in (("scheduler", scheduler, scheduler_sd), ("scaler", scaler, scaler_sd)):
        if obj is not None and sd is not None and not isinstance(sd, Mapping):
            raise RestoreRefused(f"{where}: the {name} state is a {type(sd).__name__}")


def load_checkpoint(
    source: str | os.PathLike[str] | Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and loss scaler in place from a file or an in-memory
    snapshot: all of them or none (:func:`restore_state`; ``RestoreRefused`` otherwise).

    Returns the snapshot so the caller can restore the monitor state and data position.
    """
    try:
        snap, where = _read_snapshot(source)
    except Exception:
        if is_sharded(model.parameters()):
            agree(False)  # the other ranks refuse with this one (restore_state's verdict)
        raise
    restore_state(model, snap["model"], optimizer, snap.get("optimizer"), scheduler,
                  snap.get("scheduler"), scaler, snap.get("scaler"), where=where)
    return dict(snap)


def _read_snapshot(source: str | os.PathLike[str] | Mapping[str, Any]
                   ) -> tuple[dict[str, Any], str]:
    """The snapshot of a file or an in-memory checkpoint, and how to name it in messages."""
    if isinstance(source, Mapping):
        snap: Any = dict(source)
        where = "in-memory checkpoint"
    else:
        snap = safe_torch_load(source)
        where = os.fspath(source)
    if not isinstance(snap, Mapping) or "model" not in snap:
        raise RestoreRefused(f"{where}: not a stability checkpoint (no 'model' state)")
    return dict(snap), where


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
        #: the directory whose files this store wrote and may delete (``None``: it deletes no
        #: file at all, only forgets records and in-memory copies)
        self.owned: CheckpointDirectory | None = None

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
        """Delete ``path`` only if it is a file this store wrote in its directory
        (:meth:`CheckpointDirectory.delete`); anything else a record names is left alone."""
        owned = self.owned
        if owned is not None and owned.delete(path):
            return
        if os.path.lexists(path):
            log.warning("refused to delete %s: not a checkpoint file this store wrote in its "
                        "checkpoint directory (%s); the record is forgotten, the file kept",
                        path, None if owned is None else owned.path)

    def own_directory(self, directory: CheckpointDirectory) -> None:
        """Take ``directory`` (lock it, reap its stale temporary files): from now on its files
        of the store's names are the only ones this store may delete."""
        directory.acquire()
        if self.owned is not None and self.owned is not directory:
            self.owned.release()
        self.owned = directory

    def close(self) -> None:
        """Release the checkpoint directory's lock (another run may then use it)."""
        if self.owned is not None:
            self.owned.release()

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
                       scheduler: Any, scaler: Any = None) -> dict[str, Any]:
        """Load ``rec``'s checkpoint in place (subclasses add file formats)."""
        return load_checkpoint(self._memory[rec.step], model, optimizer, scheduler, scaler)

    def restore(self, step: int, model: Any, optimizer: Any, scheduler: Any,
                scaler: Any = None) -> dict[str, Any]:
        """Load the checkpoint of ``step`` in place -- weights, optimizer, scheduler and loss
        scaler together or nothing (:class:`RestoreRefused`); returns its snapshot.

        ``KeyError`` when the ledger has no restorable checkpoint of ``step``.
        """
        rec = self.ledger.get(step)
        if rec is None:
            raise KeyError(f"No checkpoint for step {step}; have {sorted(self.entries)}")
        return self.restore_record(rec, model, optimizer, scheduler, scaler)

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
        if self.directory is not None:
            suffix = "" if self.rank < 0 else f"-rank{self.rank}"
            self.owned = CheckpointDirectory(
                self.directory, rf"step-\d{{9}}{suffix}\.pt", f".stability-lock{suffix}",
                tmp_names=rf"step-\d{{9}}{suffix}\.pt|index{suffix}\.json")
            try:
                self.owned.acquire()
            except BaseException:
                self.ledger.detach(self)
                raise
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
                if self.owned is None or self.owned.owned_name(f) is None:
                    log.warning("checkpoint index %s names %r, not a checkpoint file of this "
                                "store in %s: ignored", path, str(r["file"])[:200],
                                self.directory)
                    continue
                if f.is_file() and not f.is_symlink():
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
        return (self.owned is not None and not rec.in_memory
                and self.owned.owned_name(rec.path) is not None)

    def _write_index(self) -> None:
        path = self._index_path()
        if path is None:
            return
        rows = [{"step": r.step, "data_position": r.data_position, "healthy": r.healthy,
                 "reason": r.reason, "file": Path(r.path).name, "covers_step": r.covers,
                 "managed": r.managed}
                for r in sorted(self.ledger.records, key=lambda r: r.step) if self._mine(r)]
        try:
            assert self.owned is not None
            self.owned.write_atomic(path.name,
                                    json.dumps({"version": 2, "entries": rows}).encode())
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
             protect: Iterable[int] = (), margin: int | None = None,
             scaler: Any = None) -> CheckpointRecord:
        """Take a checkpoint, register it in the ledger, prune; returns its record.

        ``protect``: steps whose checkpoints retention must not delete now; ``margin``: the
        alarm margin retention judges health with (the policy's ``checkpoint_margin``);
        ``scaler``: the fp16 loss scaler, saved with the rest.
        """
        path = self._path(step)
        snap = save_checkpoint(path, model, optimizer, scheduler, step=step,
                               data_position=data_position, monitor_state=monitor_state,
                               healthy=healthy, reason=reason, scaler=scaler)
        if path is None:
            self._memory[int(step)] = snap
        rec = self.ledger.add(step, self._memory_path(step) if path is None else str(path),
                              healthy, reason, step, data_position=data_position, managed=True)
        self.prune(self.keep, protect, margin)
        self._write_index()
        return rec

    def restore_record(self, rec: CheckpointRecord, model: Any, optimizer: Any,
                       scheduler: Any, scaler: Any = None) -> dict[str, Any]:
        source: Any = self._memory[rec.step] if rec.in_memory else rec.path
        return load_checkpoint(source, model, optimizer, scheduler, scaler)
