"""Checkpoints, rollback and resume state of :class:`~stability.adapters.torch.TorchGuard`.

:class:`GuardCheckpoints` is a mixin of ``TorchGuard`` (which keeps the per-step path): it takes
checkpoints (periodic, emergency, on SIGTERM) into the guard's store, carries out rollbacks, and
saves / restores the guard's own state (:meth:`~GuardCheckpoints.state_dict`).

One registry: the store writes and deletes the files, the monitor's
:class:`~stability.run.checkpoints.CheckpointLedger` (the store's own without a monitor) records
them,
decides what retention deletes and what a rollback restores; after a resume the store reconciles
the ledger with the files on disk.  One goodput ledger: the counters (``steps_skipped``,
``rollbacks``, ``steps_lost``, ``checkpoints_taken``, ...) are read-only views of the monitor's
:class:`~stability.run.goodput.GoodputTracker` (the guard's own without one), which the guard feeds.
The attributes it uses are set by ``TorchGuard.__init__`` (declared below for type checking).

torch is imported at module level: this module is only imported through ``stability.adapters``
entry points that are documented to need torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from stability._state_check import Fields
from stability.adapters.interventions import LRMultiplier
from stability.adapters.torch_ops.signals import SignalCollector
from stability.outputs.feedback import InterventionTally
from stability.run.checkpoints import CheckpointLedger, CheckpointRecord
from stability.run.goodput import GoodputTracker
from stability.types import Control, Decision

__all__ = ["GuardCheckpoints", "find_ledger"]

log = logging.getLogger("stability.adapters")

STATE_VERSION = 1


def find_ledger(monitor: Any) -> CheckpointLedger | None:
    """The monitor's :class:`~stability.run.checkpoints.CheckpointLedger`, or ``None``."""
    for name in ("ledger", "checkpoints", "checkpoint_ledger"):
        led = getattr(monitor, name, None)
        if isinstance(led, CheckpointLedger):
            return led
    return None


class GuardCheckpoints:
    """Checkpoint, rollback and state methods of :class:`~stability.adapters.torch.TorchGuard`."""

    # set by TorchGuard.__init__
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    monitor: Any
    goodput: GoodputTracker
    _own_goodput: bool
    _store: Any
    recorder: Any
    collector: SignalCollector
    multiplier: LRMultiplier
    tally: InterventionTally
    decision: Decision | None
    healthy: bool
    step_count: int
    data_position: int
    skip_positions: set[int]
    _pos_of_step: OrderedDict[int, int]
    _rewound: bool
    _sigterm: Any
    _recorder_flush_failed: bool
    rolled_back: bool
    amp_overflows: int
    cadence: Any
    _last_save_t: float
    base_lr: Callable[[], AbstractContextManager[None]]

    # ------------------------------------------------------------------ the one registry
    @property
    def store(self) -> Any:
        """The checkpoint store: a
        :class:`~stability.adapters.torch_ops.checkpoint_store.LedgerStore`
        doing the file IO of :attr:`ledger`.  Assigning another store (an adapter's store of
        the trainer's own checkpoints) binds it to the same ledger."""
        return self._store

    @store.setter
    def store(self, store: Any) -> None:
        old = getattr(self, "_store", None)
        if old is not None and old is not store:
            ledger = old.ledger
            old.unbind()
            store.bind(ledger)
        self._store = store

    @property
    def ledger(self) -> CheckpointLedger:
        """The checkpoint ledger: the monitor's (``Monitor.checkpoints``), else the store's."""
        led: CheckpointLedger = self._store.ledger
        return led

    # ------------------------------------------------------------------ the goodput ledger
    @property
    def steps_skipped(self) -> int:
        """Steps whose update was not applied (``GoodputTracker.skipped``; a rollback's step
        counts as lost, not skipped)."""
        return int(self.goodput.skipped)

    @property
    def batches_skipped(self) -> int:
        """Batches a rollback asked to skip (``GoodputTracker.batches_skipped``)."""
        return int(self.goodput.batches_skipped)

    @property
    def rollbacks(self) -> int:
        """Rollbacks carried out (``GoodputTracker.rollbacks``)."""
        return int(self.goodput.rollbacks)

    @property
    def steps_lost(self) -> int:
        """Steps thrown away by rollbacks (``GoodputTracker.lost``)."""
        return int(self.goodput.lost)

    @property
    def checkpoints_taken(self) -> int:
        """Checkpoints saved (``GoodputTracker.checkpoints``)."""
        return int(self.goodput.checkpoints)

    @property
    def checkpoint_failures(self) -> int:
        """Checkpoint saves that failed (``GoodputTracker.checkpoint_failures``)."""
        return int(self.goodput.checkpoint_failures)

    def _count_step(self, step: int, own: Control, acted: Control) -> None:
        """Feed the goodput ledger this step: all of it when the guard owns the ledger; else
        the monitor counted ``own`` and only a skip asked by another rank is added."""
        if self._own_goodput:
            self._goodput("update_from_control", step, acted)
        elif acted.skip_step and not own.skip_step:
            self._goodput("mark_skipped", step)

    def _monitor_state(self) -> dict[str, Any] | None:
        if self.monitor is None or not hasattr(self.monitor, "state_dict"):
            return None
        return self.monitor.state_dict()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, healthy: bool, reason: str = "", step: int | None = None,
                        register: bool = True) -> CheckpointRecord:
        """Checkpoint model, optimizer, scheduler, monitor state and data position now.

        The store registers it in the checkpoint ledger with its health flag (``register`` is
        kept for compatibility: every checkpoint is in the ledger, which is what retention and
        rollbacks go by) and prunes what the ledger says is no longer needed.
        """
        step = self.step_count if step is None else step
        pos = self._pos_of_step.get(step, self.data_position) + 1
        self._flush_recorder()
        t0 = time.monotonic()
        with self.base_lr():  # the optimizer state holds the scheduler's own LR, not the cut
            entry: CheckpointRecord = self.store.save(
                self.model, self.optimizer, self.scheduler, step=step, data_position=pos,
                healthy=healthy, reason=reason, monitor_state=self._monitor_state(),
                protect=self._rollback_targets(), margin=self._margin(), **self._scaler_kw())
        spent = time.monotonic() - t0
        self._goodput("note_checkpoint", spent)
        if self.cadence is not None:
            self.cadence.note_save(spent)
            self._last_save_t = time.monotonic()
        return entry

    def _scaler_kw(self) -> dict[str, Any]:
        """``{"scaler": ...}`` for the store when the run has an fp16 loss scaler (its scale
        is saved and restored with the weights), else nothing (duck-typed stores)."""
        scaler = getattr(self, "scaler", None)
        return {} if scaler is None else {"scaler": scaler}

    def _preempted(self, step: int) -> None:
        """SIGTERM arrived during this step: checkpoint it, then let the signal take its course."""
        sig, self._sigterm = self._sigterm, None
        if sig is None or sig.received is None:
            return
        self._auto_checkpoint(healthy=self.healthy, reason="sigterm", step=step)
        sig.uninstall()                           # the previous handler is back ...
        os.kill(os.getpid(), sig.received)        # ... and gets the signal (default: exit)

    def _rollback_targets(self) -> set[int]:
        """Checkpoints a rollback may still need: retention keeps them.

        The ledger's latest healthy checkpoint before each of the policy's rollback anchors (the
        open episode's onset, the best validation point) and before now.
        """
        led = self.ledger
        anchors = getattr(getattr(self.monitor, "policy", None), "rollback_anchors", None)
        out = set()
        margin = self._margin()
        for at in [*(anchors() if anchors is not None else ()), self.step_count]:
            try:
                rec = led.latest_healthy_before(int(at), margin)
            except Exception:  # bookkeeping must never kill the run
                log.debug("ledger query failed", exc_info=True)
                continue
            if rec is not None:
                out.add(int(rec.step))
        return out

    def _margin(self) -> int | None:
        """The alarm margin the policy picks rollback targets with (``None``: the ledger's)."""
        cfg = getattr(getattr(self.monitor, "policy", None), "config", None)
        m = getattr(cfg, "checkpoint_margin", None)
        return m if isinstance(m, int) else None

    def _auto_checkpoint(self, healthy: bool, reason: str, step: int | None = None,
                         register: bool = True) -> CheckpointRecord | None:
        """:meth:`save_checkpoint` from :meth:`finish`: a failure never stops training.

        The first failure is logged (once per guard; later ones at debug level), every failure
        is counted in :attr:`checkpoint_failures` and recorded in the monitor's event log.
        """
        try:
            return self.save_checkpoint(healthy=healthy, reason=reason, step=step,
                                        register=register)
        except Exception as exc:  # a full disk, a failing store: training goes on
            self._goodput("note_checkpoint_failed")
            at = self.step_count if step is None else step
            if self.checkpoint_failures == 1:
                log.warning("%s checkpoint at step %s failed (%s: %s); training continues "
                            "(further checkpoint failures are logged at debug level)",
                            reason or "a", at, type(exc).__name__, exc)
            else:
                log.debug("%s checkpoint at step %s failed: %r", reason, at, exc)
            events = getattr(self.monitor, "event_log", None)
            if events is not None:
                try:
                    events.append({"type": "checkpoint_failed", "step": at, "reason": reason,
                                   "healthy": healthy, "error": f"{type(exc).__name__}: {exc}"},
                                  critical=True)
                except Exception:  # bookkeeping must never kill the run
                    log.debug("could not record the checkpoint failure", exc_info=True)
            return None

    def _flush_recorder(self) -> None:
        """Write the recorder's buffered rows, so none logged before a checkpoint can be lost."""
        flush = getattr(self.recorder, "flush", None)
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:  # the recorder keeps its rows and retries; never kill the run
            if not self._recorder_flush_failed:
                self._recorder_flush_failed = True
                log.warning("recorder flush failed (%s: %s); its rows stay buffered (reported "
                            "once)", type(exc).__name__, exc)

    def _rollback_target(self, to_step: int) -> CheckpointRecord | None:
        """The ledger's checkpoint of ``to_step``, else its latest healthy one at or before it
        (never a record whose checkpoint is gone: the ledger drops those on the way)."""
        led = self.ledger
        return led.get(to_step) or led.latest_healthy_before(int(to_step) + 1, 0)

    def rollback(self, to_step: int, skip: tuple[int, int] | None = None) -> bool:
        """Restore the checkpoint of ``to_step`` (or the latest healthy one before it).

        Batches consumed on steps ``skip[0]..skip[1]`` are added to :attr:`skip_positions`.
        Returns ``False`` (and only logs) when no checkpoint is available.  A checkpoint that
        fails to load is dropped from the ledger (logged) and the next older one is tried.
        """
        snap = entry = None
        t0 = time.monotonic()
        while snap is None:
            entry = self._rollback_target(to_step)
            if entry is None:
                break
            try:
                snap = self.store.restore(entry.step, self.model, self.optimizer, self.scheduler,
                                          **self._scaler_kw())
            except Exception as exc:  # a corrupt / vanished file: never restore it again
                log.warning("checkpoint of step %d (%s) could not be restored (%s: %s): dropped "
                            "from the ledger", entry.step, entry.path, type(exc).__name__, exc)
                self.ledger.forget(entry.step)
        if entry is None or snap is None:
            log.warning("rollback to step %s requested but no checkpoint is available: refused "
                        "(not counted)", to_step)
            if self.monitor is not None and hasattr(self.monitor, "rollback_failed"):
                self.monitor.rollback_failed(self.step_count, f"no checkpoint at or before "
                                                              f"step {to_step}")
            if self._own_goodput:
                self.goodput.cancel_rollback(self.step_count)
            return False
        if skip is not None:
            for s in range(int(skip[0]), int(skip[1]) + 1):
                if s in self._pos_of_step:
                    self.skip_positions.add(self._pos_of_step[s])
        # counted once: replaces the rollback the ledger counted from this step's Control
        self._goodput("rollback_done", self.step_count, entry.step, time.monotonic() - t0)
        issued = self.decision is not None and any(
            getattr(iv, "type", "") == "rollback" for iv in self.decision.interventions)
        if self.monitor is not None and hasattr(self.monitor, "rewind"):
            self.monitor.rewind(entry.step)  # accept steps after entry.step again
        if not issued:
            self.ledger.rewind(entry.step)  # another rank asked: keep this rank's ledger in line
        self.multiplier.restore()
        lost = self.step_count - entry.step
        self.step_count = entry.step + 1
        self.data_position = int(snap.get("data_position", entry.data_position))
        self._rewound = self.rolled_back = True
        self.collector.state_reset()
        self.optimizer.zero_grad(set_to_none=True)
        log.warning("rolled back to step %d (%d steps lost), skipping %s", entry.step, lost, skip)
        return True

    def _goodput(self, method: str, *args: Any) -> None:
        """Call ``method`` of the monitor's goodput ledger (if any); never raises."""
        if self.goodput is None:
            return
        try:
            getattr(self.goodput, method)(*args)
        except Exception:  # bookkeeping must never kill the run
            log.debug("goodput ledger %s failed", method, exc_info=True)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible guard state (monitor included) with a ``"version"`` key."""
        return {
            "version": STATE_VERSION,
            "step": self.step_count,
            "data_position": self.data_position,
            "skip_positions": sorted(self.skip_positions),
            "lr_factor": self.multiplier.factor,
            "lr_multiplier": self.multiplier.state_dict(),
            "interventions": self.tally.state_dict(),
            "monitor": self._monitor_state(),
            "counters": {"amp_overflows": self.amp_overflows},
            "goodput": self.goodput.state_dict() if self._own_goodput else None,
        }

    def load_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (fields added later fall back to defaults).

        Every field is checked before anything changes (``ValueError`` naming it): the LR
        factor and the multiplier's numbers must be finite and positive, counters and
        positions non-negative ints.  The monitor's part follows
        :meth:`~stability.monitor.monitor.Monitor.load_state_dict` (its config wins;
        ``strict=False``
        re-warms incompatible parts with a warning).
        """
        f = Fields("TorchGuard", sd)
        f.version(STATE_VERSION)
        step = f.integer("step", f.get("step", self.step_count), lo=0)
        position = f.integer("data_position", f.get("data_position", self.data_position), lo=0)
        skips = {f.integer(f"skip_positions[{i}]", x, lo=0)
                 for i, x in enumerate(f.seq("skip_positions", None, f.get("skip_positions", [])))}
        factor = f.number("lr_factor", f.get("lr_factor", 1.0), lo=0.0, low_open=True)
        mult = f.get("lr_multiplier", None)
        if mult is not None:
            m = f.sub("lr_multiplier")
            m.number("factor", m.get("factor", factor), lo=0.0, low_open=True)
            for key, pos in (("base", False), ("written", True), ("written_factor", False)):
                for i, x in enumerate(m.seq(key, None, m.get(key, []))):
                    if not (pos and x is None):
                        m.number(f"{key}[{i}]", x, lo=0.0, low_open=not pos and key != "base")
        counters = {k: f.integer(f"counters.{k}", v, lo=0)
                    for k, v in f.mapping("counters", {}).items() if k in _COUNTERS}
        goodput = f.get("goodput", None)
        if goodput is not None and self._own_goodput:
            GoodputTracker().load_state_dict(goodput)  # checked before anything changes
        tally = f.get("interventions", None)
        if tally is not None:
            InterventionTally().load_state_dict(tally)  # checked before anything changes
        self._load_monitor(f.get("monitor", None), strict)  # the last part that can refuse
        if tally is not None:
            self.tally.load_state_dict(tally)
        self.step_count, self.data_position, self.skip_positions = step, position, skips
        self.multiplier.factor = factor
        if mult is not None:
            self.multiplier.load_state_dict(mult)
        self.amp_overflows = counters.get("amp_overflows", self.amp_overflows)
        if self._own_goodput:
            if goodput is not None:
                self.goodput.load_state_dict(goodput)
            else:  # version-1 snapshots kept the counts beside the ledger
                for k, v in counters.items():
                    if k in _OLD_COUNTERS:
                        setattr(self.goodput, _OLD_COUNTERS[k], v)
        self._reconcile_ledger()
        self.collector.begin_step(self.step_count)

    def _load_monitor(self, sd: Any, strict: bool) -> None:
        """Load the monitor's part of a guard snapshot (it checks every field before it
        changes anything: a refused snapshot leaves the monitor as it was)."""
        if sd is None or self.monitor is None:
            return
        if strict:  # (a duck-typed monitor need not know the argument)
            self.monitor.load_state_dict(sd)
        else:
            self.monitor.load_state_dict(sd, strict=False)

    def _reconcile_ledger(self) -> None:
        """After a resume: the ledger lists exactly the checkpoints the store can restore.

        Records whose file is gone (and in-memory copies, which do not survive a restart) are
        dropped with a warning; files on disk the store's index knows but the restored ledger
        lacks (saved after the snapshot) are registered.
        """
        reconcile = getattr(self.store, "reconcile", None)
        if reconcile is None:
            return
        try:
            reconcile()
        except Exception:  # bookkeeping must never kill the run
            log.warning("could not reconcile the checkpoint ledger with the store", exc_info=True)


#: guard counters of version-1 snapshots -> the goodput ledger's fields
_OLD_COUNTERS = {"steps_skipped": "skipped", "batches_skipped": "batches_skipped",
                 "rollbacks": "rollbacks", "steps_lost": "lost",
                 "checkpoints_taken": "checkpoints", "checkpoint_failures": "checkpoint_failures"}
_COUNTERS = (*_OLD_COUNTERS, "amp_overflows")
