"""Checkpoints and rollbacks of :class:`~stability.adapters.torch.TorchGuard`.

:class:`GuardCheckpoints` is a collaborator the guard holds (as Lightning's Trainer holds its
``_CheckpointConnector``): it takes checkpoints (periodic, cadence, emergency, on SIGTERM) into
the guard's store, carries out rollbacks and reconciles the ledger after a resume.  The guard's
step counter, data positions, model, optimizer and scheduler stay the guard's: the collaborator
reads and sets them through its ``guard``.

One registry: the store writes and deletes the files, the monitor's
:class:`~stability.run.checkpoints.CheckpointLedger` (the store's own without a monitor) records
them, decides what retention deletes and what a rollback restores; after a resume the store
reconciles the ledger with the files on disk.  One goodput ledger: the guard's counters
(``steps_skipped``, ``rollbacks``, ``steps_lost``, ``checkpoints_taken``, ...) are read-only views
of the monitor's :class:`~stability.run.goodput.GoodputTracker` (the guard's own without one),
which :func:`note_goodput` feeds.

torch is imported at module level: this module is only imported through ``stability.adapters``
entry points that are documented to need torch.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from stability.adapters.interventions import LRMultiplier
from stability.adapters.torch_ops.sharded import agree, all_finite
from stability.adapters.torch_ops.signals import SignalCollector
from stability.adapters.trainer_support import params_finite
from stability.outputs.feedback import skipping
from stability.run.checkpoints import CheckpointLedger, CheckpointRecord
from stability.run.goodput import GoodputTracker
from stability.types import Control, Decision

__all__ = ["CheckpointedGuard", "GuardCheckpoints", "find_ledger", "note_goodput",
           "policy_anchors"]

log = logging.getLogger("stability.adapters")


def find_ledger(monitor: Any) -> CheckpointLedger | None:
    """The monitor's :class:`~stability.run.checkpoints.CheckpointLedger`, or ``None``."""
    for name in ("ledger", "checkpoints", "checkpoint_ledger"):
        led = getattr(monitor, name, None)
        if isinstance(led, CheckpointLedger):
            return led
    return None


def policy_anchors(monitor: Any) -> list[int]:
    """The steps before which the monitor's policy may still need a checkpoint (its
    ``rollback_anchors()``; none without a policy); never raises."""
    anchors = getattr(getattr(monitor, "policy", None), "rollback_anchors", None)
    if anchors is None:
        return []
    try:
        return [int(a) for a in anchors()]
    except Exception:  # bookkeeping must never kill the run
        log.debug("rollback_anchors failed", exc_info=True)
        return []


def note_goodput(goodput: GoodputTracker | None, method: str, *args: Any) -> None:
    """Call ``method`` of a goodput ledger (``None``: none); never raises."""
    if goodput is None:
        return
    try:
        getattr(goodput, method)(*args)
    except Exception:  # bookkeeping must never kill the run
        log.debug("goodput ledger %s failed", method, exc_info=True)


class CheckpointedGuard(Protocol):
    """What :class:`GuardCheckpoints` reads and sets of its guard (a
    :class:`~stability.adapters.torch.TorchGuard`).

    Read: the model, optimizer, scheduler and monitor it checkpoints, the decision in force and
    the step's health, the goodput ledger, the data positions of recent steps.  Set by a
    rollback: the step counter, the data position, the positions to skip and the rewound flags.
    """

    step_count: int
    data_position: int
    skip_positions: set[int]
    rolled_back: bool
    _rewound: bool

    @property
    def model(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Any: ...

    @property
    def monitor(self) -> Any: ...

    @property
    def sync(self) -> Any: ...

    @property
    def recorder(self) -> Any: ...

    @property
    def collector(self) -> SignalCollector: ...

    @property
    def multiplier(self) -> LRMultiplier: ...

    @property
    def goodput(self) -> GoodputTracker: ...

    @property
    def _own_goodput(self) -> bool: ...

    @property
    def _pos_of_step(self) -> Mapping[int, int]: ...

    @property
    def control(self) -> Control: ...

    @property
    def decision(self) -> Decision | None: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def checkpoint_failures(self) -> int: ...

    def base_lr(self) -> AbstractContextManager[None]: ...

    def _monitor_state(self) -> dict[str, Any] | None: ...


class GuardCheckpoints:
    """The checkpoints of one :class:`~stability.adapters.torch.TorchGuard` (``guard.checkpoints``).

    Parameters
    ----------
    guard : CheckpointedGuard
        The guard (a ``TorchGuard``) whose model, optimizer, scheduler, monitor and counters
        are checkpointed.
    store : LedgerStore
        The file IO of the one checkpoint ledger.
    every : int
        A healthy step that is a multiple of this is checkpointed (0: never).
    cadence : CadenceAdvisor, optional
        Risk-adaptive cadence (:mod:`stability.run.cadence`), besides ``every``.
    sigterm : object, optional
        The installed SIGTERM handler (:func:`stability.run.preemption.install_sigterm_checkpoint`).
    """

    def __init__(self, guard: CheckpointedGuard, store: Any, *, every: int, cadence: Any = None,
                 sigterm: Any = None) -> None:
        self.guard = guard
        self._store = store
        self.every = int(every)
        self.cadence = cadence
        self.sigterm = sigterm
        self._cadence_clock = self._last_save_t = time.monotonic()
        self._recorder_flush_failed = False
        #: the last step whose update is known healthy (the weights after it are)
        self._healthy_through = -1

    # ------------------------------------------------------------------ the one registry
    @property
    def store(self) -> Any:
        """The checkpoint store (see ``TorchGuard.store``)."""
        return self._store

    @store.setter
    def store(self, store: Any) -> None:
        old = self._store
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

    # ------------------------------------------------------------------ taking checkpoints
    def save(self, healthy: bool, reason: str = "", step: int | None = None) -> CheckpointRecord:
        """Checkpoint model, optimizer, scheduler, monitor state and data position now (see
        ``TorchGuard.save_checkpoint``)."""
        g = self.guard
        step = g.step_count if step is None else step
        pos = g._pos_of_step.get(step, g.data_position) + 1
        self._flush_recorder()
        t0 = time.monotonic()
        with g.base_lr():  # the optimizer state holds the scheduler's own LR, not the cut
            entry: CheckpointRecord = self.store.save(
                g.model, g.optimizer, g.scheduler, step=step, data_position=pos,
                healthy=healthy, reason=reason, monitor_state=g._monitor_state(),
                protect=self._rollback_targets(), margin=self._margin(), **self._scaler_kw())
        spent = time.monotonic() - t0
        note_goodput(g.goodput, "note_checkpoint", spent)
        if self.cadence is not None:
            self.cadence.note_save(spent)
            self._last_save_t = time.monotonic()
        return entry

    def auto(self, healthy: bool, reason: str, step: int | None = None) -> CheckpointRecord | None:
        """:meth:`save` at the end of a step: a failure never stops training.

        The first failure is logged (once per guard; later ones at debug level), every failure
        is counted in ``guard.checkpoint_failures`` and recorded in the monitor's event log.
        """
        try:
            return self.save(healthy=healthy, reason=reason, step=step)
        except Exception as exc:  # a full disk, a failing store: training goes on
            g = self.guard
            note_goodput(g.goodput, "note_checkpoint_failed")
            at = g.step_count if step is None else step
            if g.checkpoint_failures == 1:
                log.warning("%s checkpoint at step %s failed (%s: %s); training continues "
                            "(further checkpoint failures are logged at debug level)",
                            reason or "a", at, type(exc).__name__, exc)
            else:
                log.debug("%s checkpoint at step %s failed: %r", reason, at, exc)
            _record_failure(g.monitor, at, reason, healthy, exc)
            return None

    def before_update(self, step: int, loss: float | None) -> None:
        """A periodic checkpoint falls on an alarmed ``step``: save the weights *before* its
        update, marked by what they hold (step ``step - 1``).

        The alarm says this step's update may be bad, not that the weights it starts from are:
        they are the weights after step ``step - 1``, as healthy as a checkpoint taken at the
        end of that step -- provided step ``step - 1`` was healthy and this step's evidence
        does not point at the weights themselves (its loss, computed with them, is finite; no
        alarm blames corrupted weights; every weight is finite).  Without this, a fault on a
        checkpoint step costs a whole checkpoint interval on rollback.  Stores that cannot
        save mid-step (a trainer's own checkpoints, no in-memory budget) are left alone.
        """
        g = self.guard
        c = g.control
        if (g.healthy or not self.every or step % self.every or step < 1
                or self._healthy_through != step - 1 or c.rollback_to is not None or c.stop
                or not self._can_save_now()):
            return
        if self.ledger.get(step - 1) is not None:
            return
        ok = loss is not None and math.isfinite(loss) and not self._blames_weights()
        if g.sync is not None:  # every rank's loss and alarms: all save or none (same ledgers)
            ok = agree(ok)
        if not ok or not params_finite(g.model.parameters()):
            return
        self.auto(healthy=True, reason="periodic (before the alarmed update)", step=step - 1)

    def _blames_weights(self) -> bool:
        """This step's alarms or responses say the weights themselves are corrupted."""
        d = self.guard.decision
        if d is None:
            return False
        return (any(a.kind == "weight_corruption" for a in d.alarms)
                or any(getattr(iv, "cause", "") == "corruption" for iv in d.interventions))

    def _can_save_now(self) -> bool:
        """The store can take a checkpoint mid-step (not only the trainer's own saves)."""
        st = self.store
        return not (getattr(st, "writer", False) is None
                    and not getattr(st, "memory_limit_bytes", 0))

    def due(self, step: int) -> None:
        """The periodic / cadence checkpoint of a healthy ``step`` (its update applied);
        SIGTERM's checkpoint."""
        if self.guard.healthy:
            self._healthy_through = step
        if self.guard.healthy and ((self.every and step % self.every == 0)
                                   or (self.cadence is not None and self._cadence_due())):
            if self._weights_finite(step):
                self.auto(healthy=True, reason="periodic", step=step)
        if self.sigterm_received():
            self._preempted(step)

    def _weights_finite(self, step: int) -> bool:
        """No weight is NaN/inf (sharded: on any rank's shard, all-reduced, so the save is
        refused on every rank or none); a refusal is logged."""
        if all_finite(self.guard.collector.params):
            return True
        log.warning("periodic checkpoint at step %d refused: the weights hold non-finite "
                    "values", step)
        return False

    def sigterm_received(self) -> bool:
        """Whether SIGTERM arrived (``checkpoint_on_sigterm``) and is not yet handled."""
        return self.sigterm is not None and self.sigterm.received is not None

    def _cadence_due(self) -> bool:
        """The cadence advisor's interval has elapsed (sooner while an episode is open)."""
        assert self.cadence is not None
        now = time.monotonic()
        self.cadence.note_time(now - self._cadence_clock)
        self._cadence_clock = now
        if not self.cadence.saves:
            return True  # measure the save cost once
        policy = getattr(self.guard.monitor, "policy", None)  # scripted monitors have none
        warnings_open = getattr(policy, "episode_onset", None) is not None
        return bool(self.cadence.should_checkpoint(now - self._last_save_t, warnings_open))

    def _scaler_kw(self) -> dict[str, Any]:
        """``{"scaler": ...}`` for the store when the run has an fp16 loss scaler (its scale
        is saved and restored with the weights), else nothing (duck-typed stores)."""
        scaler = getattr(self.guard, "scaler", None)
        return {} if scaler is None else {"scaler": scaler}

    def _preempted(self, step: int) -> None:
        """SIGTERM arrived during this step: checkpoint it, then let the signal take its course."""
        sig, self.sigterm = self.sigterm, None
        if sig is None or sig.received is None:
            return
        self.auto(healthy=self.guard.healthy, reason="sigterm", step=step)
        sig.uninstall()                           # the previous handler is back ...
        os.kill(os.getpid(), sig.received)        # ... and gets the signal (default: exit)

    def rollback_targets(self) -> set[int]:
        """:meth:`_rollback_targets` (for the trainer callbacks' own retention)."""
        return self._rollback_targets()

    def _rollback_targets(self) -> set[int]:
        """Checkpoints a rollback may still need: retention keeps them.

        The ledger's latest healthy checkpoint before each of the policy's rollback anchors (the
        open episode's onset, the best validation point) and before now.
        """
        led = self.ledger
        sync = self.guard.sync  # several ranks: the anchors of all of them (same everywhere)
        anchors = policy_anchors(self.guard.monitor) if sync is None else list(sync.anchors)
        out = set()
        margin = self._margin()
        for at in [*anchors, self.guard.step_count]:
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
        cfg = getattr(getattr(self.guard.monitor, "policy", None), "config", None)
        m = getattr(cfg, "checkpoint_margin", None)
        return m if isinstance(m, int) else None

    def _flush_recorder(self) -> None:
        """Write the recorder's buffered rows, so none logged before a checkpoint can be lost."""
        flush = getattr(self.guard.recorder, "flush", None)
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:  # the recorder keeps its rows and retries; never kill the run
            if not self._recorder_flush_failed:
                self._recorder_flush_failed = True
                log.warning("recorder flush failed (%s: %s); its rows stay buffered (reported "
                            "once)", type(exc).__name__, exc)

    # ------------------------------------------------------------------ rollbacks
    def rollback(self, to_step: int, skip: tuple[int, int] | None = None) -> bool:
        """Restore the checkpoint of ``to_step`` (see ``TorchGuard.rollback``)."""
        g = self.guard
        t0 = time.monotonic()
        entry, snap = self._restore(to_step)
        if entry is None or snap is None:
            self._refused(to_step)
            return False
        if skip is not None:
            for s in range(int(skip[0]), int(skip[1]) + 1):
                if s in g._pos_of_step:
                    g.skip_positions.add(g._pos_of_step[s])
        # counted once: replaces the rollback the ledger counted from this step's Control
        note_goodput(g.goodput, "rollback_done", g.step_count, entry.step, time.monotonic() - t0)
        issued = g.decision is not None and any(
            getattr(iv, "type", "") == "rollback" for iv in g.decision.interventions)
        if g.monitor is not None and hasattr(g.monitor, "rewind"):
            g.monitor.rewind(entry.step)  # accept steps after entry.step again
        if not issued:
            self.ledger.rewind(entry.step)  # another rank asked: keep this rank's ledger in line
        g.multiplier.restore()
        lost = g.step_count - entry.step
        self._healthy_through = entry.step  # the restored weights are healthy
        g.step_count = entry.step + 1
        g.data_position = int(snap.get("data_position", entry.data_position))
        g._rewound = g.rolled_back = True
        g.collector.state_reset()
        g.optimizer.zero_grad(set_to_none=True)
        log.warning("rolled back to step %d (%d steps lost)%s", entry.step, lost,
                    skipping(*(skip or (None, None))))
        return True

    def restore_in_place(self, to_step: int) -> bool:
        """Restore the weights and optimizer state (and loss scale) of the checkpoint of
        ``to_step`` -- or the latest healthy one before it -- *keeping* the step counter, the
        scheduler, the optimizer's hyperparameters (its LR) and the data position: the run goes
        on from the next step, and the faulty step is not replayed (a deterministic fault
        recurs when its step is replayed).  The steps since the checkpoint are lost (counted in
        ``steps_lost`` and ``steps_lost_in_place``).  ``False`` (logged) when no checkpoint can
        be restored."""
        g = self.guard
        t0 = time.monotonic()
        g.multiplier.restore()  # the groups hold the scheduler's own LR
        hyper = [{k: v for k, v in grp.items() if k != "params"}
                 for grp in g.optimizer.param_groups]
        entry, _ = self._restore(to_step, scheduler=False)
        if entry is None:
            self._refused(to_step)
            return False
        for grp, h in zip(g.optimizer.param_groups, hyper, strict=False):
            grp.update(h)  # the position's hyperparameters, not the checkpoint's
        step = g.step_count
        note_goodput(g.goodput, "rollback_done", step, entry.step, time.monotonic() - t0)
        note_goodput(g.goodput, "note_lost_in_place", step - entry.step)
        self._healthy_through = step  # the weights now in the model are healthy
        g.rolled_back = True
        g.collector.state_reset()
        g.optimizer.zero_grad(set_to_none=True)
        log.warning("restored the weights of step %d at step %d, keeping the position (%d steps "
                    "lost; the faulty step is not replayed)", entry.step, step, step - entry.step)
        return True

    def _restore(self, to_step: int, scheduler: bool = True
                 ) -> tuple[CheckpointRecord | None, dict[str, Any] | None]:
        """Restore the ledger's checkpoint of ``to_step``, else its latest healthy one at or
        before it; a checkpoint that fails to load is dropped from the ledger (logged) and the
        next older one is tried.  ``(None, None)`` when none is left.  ``scheduler=False``
        leaves the scheduler as it is."""
        g = self.guard
        while True:
            led = self.ledger
            entry = led.get(to_step) or led.latest_healthy_before(int(to_step) + 1, 0)
            if entry is None:
                return None, None
            try:
                return entry, self.store.restore(entry.step, g.model, g.optimizer,
                                                  g.scheduler if scheduler else None,
                                                  **self._scaler_kw())
            except Exception as exc:  # a corrupt / vanished file: never restore it again
                log.warning("checkpoint of step %d (%s) could not be restored (%s: %s): dropped "
                            "from the ledger", entry.step, entry.path, type(exc).__name__, exc)
                led.forget(entry.step)

    def _refused(self, to_step: int) -> None:
        """No checkpoint to roll back to: logged, reported to the monitor, not counted."""
        g = self.guard
        log.warning("rollback to step %s requested but no checkpoint is available: refused "
                    "(not counted)", to_step)
        if g.monitor is not None and hasattr(g.monitor, "rollback_failed"):
            g.monitor.rollback_failed(g.step_count, f"no checkpoint at or before step {to_step}")
        if g._own_goodput:
            g.goodput.cancel_rollback(g.step_count)

    def reconcile(self) -> None:
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


def _record_failure(monitor: Any, step: int, reason: str, healthy: bool, exc: Exception) -> None:
    """A failed checkpoint in the monitor's event log (if any); never raises."""
    events = getattr(monitor, "event_log", None)
    if events is None:
        return
    try:
        events.append({"type": "checkpoint_failed", "step": step, "reason": reason,
                       "healthy": healthy, "error": f"{type(exc).__name__}: {exc}"},
                      critical=True)
    except Exception:  # bookkeeping must never kill the run
        log.debug("could not record the checkpoint failure", exc_info=True)
