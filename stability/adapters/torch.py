"""Guard a plain PyTorch training loop with a :class:`~stability.monitor.monitor.Monitor`.

The guard measures the signals itself (one host sync per step), asks the monitor, and carries out
the decision for real: clip, LR multiplier surviving the scheduler, skipped step, emergency
checkpoint, rollback with skipped batches, clean stop (:class:`TrainingStopped`).

Example (index-addressable data, so a rollback can rewind and skip the offending batches)::

    import stability.torch
    from stability.monitor.monitor import Monitor

    guard = stability.torch.attach(model, optimizer, scheduler, Monitor("small"),
                                   checkpoint_dir="ckpt", checkpoint_every=100)
    for i in guard.batches(n_batches):          # honours rollbacks and skipped batches
        x, y = get_batch(i)
        loss = loss_fn(model(x), y)
        loss.backward()
        guard.step(loss)                        # measure, decide, clip, step, schedule, zero_grad

``guard.step`` raises :class:`TrainingStopped` when the monitor asks to stop. With an ordinary
(non-rewindable) iterator use ``for batch in loader: ...`` the same way: a rollback then restores
the weights and training simply goes on with fresh batches (the bad ones are behind it).

Lower-level use, for loops that call the optimizer themselves::

    loss.backward()
    decision = guard.check(loss)     # signals + decision; clips / drops grads as requested
    if guard.should_step:
        optimizer.step()
    scheduler.step(); optimizer.zero_grad()
    guard.finish()                   # checkpoints, rollback, stop

Skipped steps: the gradients are dropped and the optimizer does not step; the scheduler still
advances by default (``step_scheduler_on_skip=True``) so the LR schedule stays aligned with the
data position -- set it to ``False`` to freeze the schedule on skipped steps instead.

Deferred decisions (``sync="deferred"``, see :mod:`stability.adapters.guard.deferred`): no host sync
on the step path; step ``t``'s signals are copied to the host in the background and observed
during step ``t + 1``, whose update the decision already governs (one step late), with the device
clipping the gradients and keeping non-finite ones from the weights.  Call :meth:`flush` at the
end of training (:meth:`detach` does) so the last step's signals are observed.  The default,
``sync="auto"``, takes the deferred path on CUDA with a fused optimizer and the step path (one
host sync per step) elsewhere (:mod:`stability.adapters.guard.sync_mode`).

Steps: the monitor step is the guard's optimizer-step counter. A rollback to the checkpoint of
step ``s`` sets it back to ``s + 1`` together with the model, optimizer, scheduler and data
position (the monitor's own state is *not* rolled back: it must remember what happened).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from stability._state_check import Fields
from stability.adapters.distributed import ControlSync
from stability.adapters.guard.canary import CANARY_KEY, CanarySet, LossFn
from stability.adapters.guard.checkpoints import (
    GuardCheckpoints,
    find_ledger,
    note_goodput,
    policy_anchors,
)
from stability.adapters.guard.deferred import DeferredSteps
from stability.adapters.guard.feedback import GuardFeedback
from stability.adapters.guard.misuse import MisuseChecks, check_scheduler_arg
from stability.adapters.guard.sync_mode import SyncPath, check_sync
from stability.adapters.interventions import (
    CheckpointStore,
    LRMultiplier,
    TrainingStopped,
    clip_gradients,
    drop_gradients,
    restore_outcome,
    tightest_clip,
)
from stability.adapters.torch_ops.amp import (
    AMP_OVERFLOW,
    LOSS_SCALE,
    ensure_unscaled,
    scaler_enabled,
)
from stability.adapters.torch_ops.signals import SignalCollector, Signals
from stability.outputs.feedback import InterventionTally, log_interventions
from stability.run.cadence import CadenceAdvisor
from stability.run.checkpoints import CheckpointLedger, CheckpointRecord
from stability.run.goodput import GoodputTracker
from stability.run.preemption import install_sigterm_checkpoint
from stability.run.watchdog import StallWatchdog
from stability.types import Control, Decision

__all__ = ["TorchGuard", "TrainingStopped", "attach", "find_ledger"]

log = logging.getLogger("stability.adapters")

STATE_VERSION = 1


class TorchGuard:
    """Signals in, decisions out, interventions carried out on real objects.

    The guard keeps the step: counters, data positions, the decision and its control, the
    measuring and the acting.  It holds three named collaborators: :attr:`checkpoints`
    (:class:`~stability.adapters.guard.checkpoints.GuardCheckpoints`: saves, rollbacks, cadence,
    SIGTERM), :attr:`sync_path` (:class:`~stability.adapters.guard.sync_mode.SyncPath`: the
    ``sync=`` mode and the deferred machinery) and :attr:`feedback`
    (:class:`~stability.adapters.guard.feedback.GuardFeedback`: the ``stability/*`` metrics).
    ``sync`` names the :class:`~stability.adapters.distributed.ControlSync` (``None`` on one
    rank).

    Parameters
    ----------
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer
    scheduler : LR scheduler, optional
    monitor : Monitor, optional
        ``None`` only measures signals (and applies ``clip_norm``).
    checkpoint_dir : path-like, optional
        Where checkpoints go; ``None`` keeps them in memory (CPU copies).
    checkpoint_every : int
        Take a checkpoint every this many steps when the step is healthy (0 = never).
    keep_checkpoints : int
        How many checkpoints to retain.
    clip_norm : float, optional
        The loop's own clipping norm (used when the monitor has not set one; the tighter wins).
    step_scheduler_on_skip : bool
        Whether the scheduler advances on a skipped step.
    layer_depth, update_ratio_every, param_norm_every, activations, activation_every
        Passed to :class:`~stability.adapters.torch_ops.signals.SignalCollector` (weights read every
        2 / 4 steps by default; 1 = every step).
    update_ratio : {"sampled", "exact"}
        How update ratios are measured: ``"sampled"`` (default) copies no full parameter (about
        4096 elements per tensor; ~1% error with AdamW, a few % with SGD), ``"exact"`` copies
        every parameter when a ratio is due (see :mod:`stability.adapters.torch_ops.signals`).
    recorder : object with ``log(step, metrics)``, optional
        Gets every step's signals (rank 0 only), e.g. ``replay.recorder.RunRecorder``.
    distributed : bool or ControlSync, optional
        Reduce decisions across ranks (default: when torch.distributed is initialised); pass
        ``ControlSync(ranks=True, signals=...)`` to also name the culprit rank.
    raise_on_stop : bool
        Raise :class:`TrainingStopped` from :meth:`finish` when asked to stop.
    scaler : torch.amp.GradScaler, optional
        The loss scaler of an fp16 run.  The loop calls ``scaler.scale(loss).backward()``;
        :meth:`step` then unscales, measures, decides, clips, ``scaler.step(optimizer)``,
        ``scaler.update()``.  A scaler overflow step is reported as ``amp_overflow = 1`` with
        ``loss_scale`` and *without* gradient norms (see :mod:`stability.adapters.torch_ops.amp`).
    log_interventions : bool
        Log one INFO line per acting intervention on the ``stability.adapters`` logger.
    watchdog : bool or StallWatchdog, optional
        Stall watchdog (:mod:`stability.run.watchdog`): ``True`` builds one reporting through the
        monitor's sinks and event log (``StallWatchdog.for_monitor``); the guard beats it after
        every step and passes its ``step_time`` (and throughput / MFU when configured) to the
        monitor.  Stopped by :meth:`detach`.
    cadence : CadenceAdvisor, optional
        Risk-adaptive checkpoint cadence (:mod:`stability.run.cadence`): besides
        ``checkpoint_every``,
        a healthy step is checkpointed when the advisor's goodput-optimal interval (from the
        measured save cost and the failure rate) has elapsed since the last save -- sooner while
        the policy has an episode open.  The first healthy step is saved to measure the cost.
    checkpoint_on_sigterm : bool
        Preemption: on SIGTERM, checkpoint at the end of the current step (never mid-update),
        then hand the signal to the previous handler (default: the process exits).  Main
        thread only (see :mod:`stability.run.preemption`).
    sync : {"auto", "step", "deferred"}
        ``"step"``: one host sync per step, the decision acts on the step it was made for.
        ``"deferred"``: no host sync on the step path, decisions act one step late, device-side
        clipping and non-finite protection (:mod:`stability.adapters.guard.deferred`).  ``"auto"``
        (default): ``"deferred"`` on CUDA with a fused optimizer, else ``"step"``, resolved at
        the first step (:mod:`stability.adapters.guard.sync_mode`; :attr:`sync_mode` tells which).
    canary : int or CanarySet, optional
        A canary set (:mod:`stability.adapters.guard.canary`): keep this many early healthy
        batches (handed in with :meth:`offer_batch`) and report their loss as ``canary_loss``
        every ``canary_every`` steps, so that memorisation of bad data is seen without a
        validation set.  An int needs ``canary_loss``.  Off by default (``None`` / 0).
    canary_loss : callable, optional
        ``canary_loss(model, batch)``: the loop's loss of a batch (for ``canary=int``).
    canary_every : int, optional
        Steps between canary evaluations (default ``checkpoint_every``, else 100).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        monitor: Any = None,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 100,
        keep_checkpoints: int = 4,
        clip_norm: float | None = None,
        step_scheduler_on_skip: bool = True,
        layer_depth: int | None = None,
        update_ratio_every: int = 4,
        activations: Any = None,
        activation_every: int = 10,
        recorder: Any = None,
        distributed: bool | ControlSync | None = None,
        raise_on_stop: bool = True,
        start_step: int = 0,
        scaler: Any = None,
        log_interventions: bool = True,
        checkpoint_on_sigterm: bool = False,
        update_ratio: str = "sampled",
        watchdog: bool | StallWatchdog | None = None,
        cadence: CadenceAdvisor | None = None,
        sync: str = "auto",
        param_norm_every: int = 2,
        canary: int | CanarySet | None = None,
        canary_loss: LossFn | None = None,
        canary_every: int | None = None,
    ) -> None:
        check_sync("TorchGuard", sync)
        if checkpoint_every < 0:
            raise ValueError("The 'checkpoint_every' parameter of TorchGuard must be an int in "
                             f"the range [0, inf). Got {checkpoint_every} instead.")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.monitor = monitor
        self.clip_norm = clip_norm
        self.step_scheduler_on_skip = step_scheduler_on_skip
        self.raise_on_stop = raise_on_stop
        if monitor is not None and hasattr(monitor, "trainer_clip_norm"):
            monitor.trainer_clip_norm = clip_norm  # the policy never loosens the loop's clip
        self._init_goodput(monitor)
        self.collector = SignalCollector(
            model, layer_depth=layer_depth, update_ratio_every=update_ratio_every,
            activations=_activation_names(model, activations), activation_every=activation_every,
            update_ratio=update_ratio, param_norm_every=param_norm_every)
        check_scheduler_arg(scheduler)  # attach(model, opt, Monitor(...)): TypeError now
        self.multiplier = LRMultiplier(optimizer, scheduler=scheduler)
        self.misuse = MisuseChecks(self)
        self._goodput_recorded = -1  # step_count of the last goodput record (record_goodput)
        self.scaler = scaler if scaler_enabled(scaler) else None
        self.log_interventions = log_interventions
        self.tally = InterventionTally()
        self.amp_overflow = False  # the current step overflowed in the scaler
        self.sync = distributed if isinstance(distributed, ControlSync) else (
            ControlSync() if distributed in (None, True) else None)
        if self.sync is not None and not self.sync.active:
            self.sync = None
        rank = self.sync.rank if self.sync is not None else -1
        self.recorder = recorder if rank <= 0 else None
        self._init_step(int(start_step))
        # a CheckpointStore, or an adapter's store of the trainer's own checkpoints: the file
        # IO of the one checkpoint ledger (the monitor's, else the store's own)
        self.checkpoints = GuardCheckpoints(
            self, CheckpointStore(checkpoint_dir, keep=keep_checkpoints, rank=rank,
                                  ledger=find_ledger(monitor)),
            every=checkpoint_every, cadence=cadence,
            sigterm=(install_sigterm_checkpoint(lambda: None, chain=False)
                     if checkpoint_on_sigterm else None))
        self.sync_path = SyncPath(self, sync)
        self.feedback = GuardFeedback(self)
        self.watchdog: StallWatchdog | None = (
            watchdog if isinstance(watchdog, StallWatchdog)
            else StallWatchdog.for_monitor(self.monitor) if watchdog else None)
        self.canary = make_canary(canary, canary_loss, canary_every, checkpoint_every)

    def _init_goodput(self, monitor: Any) -> None:
        """The goodput ledger: the monitor's, else the guard's own.

        The monitor's ledger counts every step from its Control (rollbacks as requested); the
        guard adds what only it knows: the wall clock, checkpoint save times, the rollback it
        really did (which replaces the requested one), skipped batches.  Without a monitor
        ledger the guard keeps (and feeds) its own.
        """
        goodput = getattr(monitor, "goodput", None)
        self._own_goodput = not isinstance(goodput, GoodputTracker)
        self.goodput: GoodputTracker = goodput if isinstance(goodput, GoodputTracker) else (
            GoodputTracker())
        note_goodput(self.goodput, "start")

    def _init_step(self, start_step: int) -> None:
        """The step's state: counters, data positions, the decision in force."""
        self.step_count = start_step
        self.data_position = 0
        self.skip_positions: set[int] = set()
        self._pos_of_step: OrderedDict[int, int] = OrderedDict()
        self._families_declared = False
        self._pending: dict[str, float] = {}
        self._consumed = False
        self._rewound = False
        self.control = Control()
        self.decision: Decision | None = None
        self.healthy = True
        self.should_step = True
        self.stopped: TrainingStopped | None = None
        self.rolled_back = False  # whether the last finish() rolled back
        # goodput counters (steps_skipped, rollbacks, ...) are views of self.goodput
        self.amp_overflows = 0
        #: steps lost to restores that kept the position (in ``steps_lost``; not rewound)
        self.steps_lost_in_place = 0
        self.interventions: list[Any] = []
        self.collector.begin_step(self.step_count)

    # ------------------------------------------------------------------ collaborators' views
    @property
    def sync_requested(self) -> str:
        """What ``sync=`` the guard was built with: ``"auto"``, ``"step"`` or ``"deferred"``."""
        return self.sync_path.requested

    @property
    def sync_mode(self) -> str:
        """The step path taken: ``"step"`` or ``"deferred"`` (``"auto"`` until resolved)."""
        return self.sync_path.mode

    @property
    def deferred(self) -> DeferredSteps | None:
        """The deferred machinery (:class:`~stability.adapters.guard.deferred.DeferredSteps`)
        while it runs; ``None`` in step mode."""
        return self.sync_path.deferred

    def resolve_sync(self) -> str:
        """The step path, ``"step"`` or ``"deferred"``; resolves ``sync="auto"`` the first time
        (see :meth:`~stability.adapters.guard.sync_mode.SyncPath.resolve`)."""
        return self.sync_path.resolve()

    @property
    def store(self) -> Any:
        """The checkpoint store: a
        :class:`~stability.adapters.torch_ops.checkpoint_store.LedgerStore` doing the file IO
        of :attr:`ledger`.  Assigning another store (an adapter's store of the trainer's own
        checkpoints) binds it to the same ledger."""
        return self.checkpoints.store

    @store.setter
    def store(self, store: Any) -> None:
        self.checkpoints.store = store

    @property
    def ledger(self) -> CheckpointLedger:
        """The checkpoint ledger: the monitor's (``Monitor.checkpoints``), else the store's."""
        return self.checkpoints.ledger

    @property
    def checkpoint_every(self) -> int:
        """A healthy step that is a multiple of this is checkpointed (0: never)."""
        return self.checkpoints.every

    @property
    def cadence(self) -> CadenceAdvisor | None:
        """The risk-adaptive checkpoint cadence, if any."""
        cadence: CadenceAdvisor | None = self.checkpoints.cadence
        return cadence

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
            note_goodput(self.goodput, "update_from_control", step, acted)
        elif acted.skip_step and not own.skip_step:
            note_goodput(self.goodput, "mark_skipped", step)

    # ------------------------------------------------------------------ data
    def batches(self, n_batches: int, max_iterations: int | None = None) -> Iterator[int]:
        """Yield the indices of the batches to train on, honouring rollbacks and skips.

        Parameters
        ----------
        n_batches : int
            Train until this many batch positions are consumed.
        max_iterations : int, optional
            Hard cap on yielded batches (default ``4 * n_batches``), against rollback loops.
        """
        cap = 4 * n_batches if max_iterations is None else max_iterations
        it = 0
        while self.data_position < n_batches and it < cap:
            idx = self.data_position
            if idx in self.skip_positions:
                self.data_position += 1
                note_goodput(self.goodput, "note_batch_skipped")
                continue
            self._consumed = self._rewound = False
            it += 1
            yield idx
            if not (self._consumed or self._rewound):
                self.data_position = idx + 1
        self.record_goodput()  # all batches consumed: the end of training

    def should_skip_batch(self, position: int) -> bool:
        """Whether the batch at ``position`` is one a rollback asked to skip."""
        return position in self.skip_positions

    def offer_batch(self, batch: Any) -> bool:
        """Hand in this step's training batch for the canary set (``attach(..., canary=K)``):
        kept (a detached copy) while the set fills during the healthy start; a no-op
        otherwise.  Call before :meth:`step`.  Returns whether it was kept."""
        if self.canary is None or not self.healthy:
            return False
        return self.canary.offer(batch, self.step_count)

    def validation(self, val_loss: float, **metrics: float) -> None:
        """Hand in a validation result; it joins the next step's metrics."""
        self._pending["val_loss"] = float(val_loss)
        self._pending.update({k: float(v) for k, v in metrics.items()})

    # ------------------------------------------------------------------ one step
    def step(self, loss: Any, metrics: Mapping[str, Any] | None = None) -> Decision:
        """Everything after ``loss.backward()``: decide, clip, step, schedule, zero_grad.

        Returns the monitor's :class:`~stability.types.Decision` (``sync="deferred"``: the one
        observed during this call, the previous step's, or ``Decision(-1)`` when none was);
        raises :class:`TrainingStopped` when the monitor stops the run.
        """
        if self.sync_mode == "auto":
            self.resolve_sync()
        if self.deferred is not None:
            self.misuse.before_check(loss)
            return self.deferred.step(loss, metrics)
        decision = self.check(loss, metrics)
        try:
            if self.scaler is not None:
                if self.should_step:
                    self.scaler.step(self.optimizer)  # itself skips an overflow step
                self.scaler.update()
            elif self.should_step:
                self.optimizer.step()
            self.multiplier.restore()  # the scheduler reads and writes its own values
            if self.scheduler is not None and (self.should_step or self.step_scheduler_on_skip):
                self.scheduler.step()
                self.misuse.scheduler_stepped()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.finish()
        self.multiplier.show()  # between steps param_groups show the LR really applied
        if self.watchdog is not None:
            self.watchdog.beat(decision.step)
        return decision

    def collect(self, loss: Any, metrics: Mapping[str, Any] | None = None) -> Signals:
        """Measure this step's signals (one host sync); adds ``lr`` and pending validation."""
        return self._amp_post(self.collector.collect(loss, self._extra(metrics)))

    def _extra(self, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        """The step's signals besides the collector's: LR, AMP, validation, watchdog, own."""
        extra: dict[str, Any] = {"lr": self.multiplier.base_lrs()[0]}
        if self.scaler is not None:
            extra.update(self._amp_extra())
        extra.update(self._pending)
        self._pending = {}
        if self.canary is not None and self.canary.due(self.step_count):
            extra[CANARY_KEY] = self.canary.evaluate(self.model)  # evaluation steps only
        if self.watchdog is not None:
            extra.update(self.watchdog.metrics())
        if metrics:
            extra.update(metrics)
        return extra

    def _amp_post(self, sig: Signals) -> Signals:
        """Sets :attr:`amp_overflow`; an overflow step reports no gradient norms."""
        if self.scaler is not None and AMP_OVERFLOW not in sig.scalars:
            # a scaler without a found-inf record: non-finite unscaled grads are what it skips
            sig.scalars[AMP_OVERFLOW] = float(not math.isfinite(sig.scalars.get("grad_norm", 0.0)))
        self.amp_overflow = bool(sig.scalars.get(AMP_OVERFLOW, 0.0) > 0.0)
        if self.amp_overflow:  # non-finite by construction: missing, not NaN
            sig.scalars.pop("grad_norm", None)
            sig.families.pop("grad_norm", None)
        return sig

    def _amp_extra(self) -> dict[str, Any]:
        """Unscale the gradients; ``amp_overflow`` and ``loss_scale`` as device tensors."""
        scaler = self.scaler
        out: dict[str, Any] = {}
        ensure_unscaled(scaler, self.optimizer)
        try:
            infs = list(scaler._found_inf_per_device(self.optimizer).values())  # type: ignore
            if infs:
                dev = infs[0].device
                out[AMP_OVERFLOW] = (torch.stack([t.to(dev).reshape(()) for t in infs]).sum()
                                     > 0).float()
        except Exception:  # a scaler-like object without the record
            log.debug("no found-inf record on the scaler", exc_info=True)
        scale = getattr(scaler, "_scale", None)
        out[LOSS_SCALE] = scale if isinstance(scale, torch.Tensor) else scaler.get_scale()  # type: ignore
        return out

    def check(self, loss: Any, metrics: Mapping[str, Any] | None = None,
              signals: Signals | None = None) -> Decision:
        """Measure, decide and prepare the optimizer step (clip / LR factor / drop grads).

        Call after ``backward()`` and before ``optimizer.step()``; read :attr:`should_step`.
        """
        if self.sync_mode == "auto":
            self.resolve_sync()
        if signals is None:  # (a trainer adapter measured them: it ran backward itself)
            self.misuse.before_check(loss)
        if self.deferred is not None:
            return self.deferred.check(loss, metrics, signals)
        step = self.step_count
        self._pos_of_step[step] = self.data_position
        while len(self._pos_of_step) > 100_000:
            self._pos_of_step.popitem(last=False)
        sig = signals if signals is not None else self.collect(loss, metrics)
        decision = self._decide(step, sig)
        control = self.control
        # act before the optimizer step
        self.multiplier.factor = float(control.lr_factor)
        self.should_step = not (control.skip_step or control.rollback_to is not None
                                or control.stop)
        if self.should_step and self.amp_overflow:
            # the scaler skips this step itself: nothing to clip, no update to measure
            self.multiplier.restore()
        elif self.should_step:
            norm = tightest_clip(self.clip_norm, control.clip_norm)
            if norm is not None:
                clip_gradients(self.collector.params, norm, sig.scalars.get("grad_norm"),
                               self.collector.local_grads())
            self.collector.before_step(step)
            self.multiplier.apply()  # idempotent; also done by the optimizer pre-hook
        else:
            drop_gradients(self.collector.params)
        if not self.healthy:  # a fault on a checkpoint step: its pre-update state is healthy
            self.checkpoints.before_update(step, _finite_loss(sig))
        return decision

    def _decide(self, step: int, sig: Signals) -> Decision:
        """Observe ``step``, reduce across ranks, record; sets decision / control / healthy."""
        decision = self._observe(step, sig)
        control = decision.control
        alarmed = bool(decision.alarms)
        if self.sync is not None:
            control, alarmed = self.sync.reduce(control, step, alarmed,
                                                loss=sig.scalars.get("loss"),
                                                grad_norm=sig.scalars.get("grad_norm"),
                                                anchors=policy_anchors(self.monitor))
            ranked = self.sync.rank_alarms
            if ranked and self.sync.rank == 0:  # identical everywhere: rank 0 records them
                report = getattr(self.monitor, "report_alarms", None)  # scripted monitors lack it
                if report is not None:
                    report(step, ranked)
        self.decision, self.control, self.healthy = decision, control, not alarmed
        if alarmed and self.canary is not None and not self.canary.closed:
            self.canary.close(step)  # the healthy start is over
        self.interventions.extend(decision.interventions)
        if decision.interventions:
            self.tally.add(decision)
            if self.log_interventions:
                log_interventions(decision, log)
        if self.recorder is not None:
            self.recorder.log(step, sig.flat(self.collector.layers))
        if self.amp_overflow:
            self.amp_overflows += 1
        self._count_step(step, decision.control, control)
        return decision

    def finish(self) -> None:
        """After the optimizer/scheduler step: checkpoints, rollback, stop; advances the step."""
        if self.deferred is not None:
            self.deferred.finish()
            return
        control, step = self.control, self.step_count
        self.rolled_back = False
        self.collector.after_step(stepped=self.should_step)
        self._consumed = True
        if control.save_checkpoint:  # unhealthy: kept for forensics, never a rollback target
            self.checkpoints.auto(healthy=False, reason=control.checkpoint_reason or "emergency")
        if self._end_run(step, control, self.raise_on_stop):
            return
        self.checkpoints.due(step)  # the weights are those after this step's update
        self.step_count += 1
        self.data_position = self._pos_of_step.get(step, self.data_position) + 1
        self.collector.begin_step(self.step_count)
        self.multiplier.show()  # between steps param_groups show the LR really applied

    def _end_run(self, step: int, control: Control, raise_stop: bool) -> bool:
        """Carry out a stop or rollback requested for ``step`` (either step path); ``True``
        when one was.  A stop with a rollback target stops with the last good weights."""
        if control.stop:
            restored = None
            if control.rollback_to is not None and self.rollback(control.rollback_to, None):
                # stop with the last good weights in place (the run cannot be brought back)
                restored = self.step_count - 1
            reason = restore_outcome(control.stop_reason or "stop requested",
                                     control.rollback_to, restored, step)
            if reason != (control.stop_reason or "stop requested"):
                log.warning("stop at step %d: %s", step, reason)  # the logged stop said otherwise
            self.stopped = TrainingStopped(
                reason, step, self.decision.alarms if self.decision else (), self.decision,
                restored_step=restored)
            self.step_count += 1
            self.data_position += 1
            self.record_goodput()  # the end of the run: `stability goodput EVENTS` has it
            if raise_stop:
                raise self.stopped
            return True
        if control.rollback_to is not None and control.keep_position:
            # the healthy weights back, the position kept: the run goes on from the next step
            self.checkpoints.restore_in_place(control.rollback_to)
            return False
        if control.rollback_to is not None and self.rollback(control.rollback_to,
                                                             control.skip_batches):
            self.collector.begin_step(self.step_count)
            return True
        return False

    def flush(self) -> Decision | None:
        """Observe the pending step of a ``sync="deferred"`` guard and carry out its decision
        (call at the end of training; :meth:`detach` does).  Returns that decision (``None``:
        nothing pending, or ``sync="step"``); raises :class:`TrainingStopped` like ``step``."""
        if self.deferred is None:
            return None
        return self.deferred.flush(self.raise_on_stop)

    def _flush_quietly(self) -> None:
        """:meth:`flush` that never raises (a stop is logged and kept in :attr:`stopped`)."""
        if self.deferred is None:
            return
        try:
            self.deferred.flush(False)
        except Exception:  # never crash the user's run on the way out
            log.warning("observing the last pending step failed", exc_info=True)
        if self.stopped is not None:
            log.warning("the last step asked to stop: %s", self.stopped)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, healthy: bool, reason: str = "", step: int | None = None,
                        register: bool = True) -> CheckpointRecord:
        """Checkpoint model, optimizer, scheduler, monitor state and data position now.

        The store registers it in the checkpoint ledger with its health flag (``register`` is
        kept for compatibility: every checkpoint is in the ledger, which is what retention and
        rollbacks go by) and prunes what the ledger says is no longer needed.  A pending
        ``sync="deferred"`` step is observed first (the checkpoint's monitor state has every
        step).
        """
        if self.deferred is not None and self.deferred.pending is not None:
            self.deferred.flush(False)
        return self.checkpoints.save(healthy, reason, step)

    def rollback(self, to_step: int, skip: tuple[int, int] | None = None) -> bool:
        """Restore the checkpoint of ``to_step`` (or the latest healthy one before it).

        Batches consumed on steps ``skip[0]..skip[1]`` are added to :attr:`skip_positions`.
        Returns ``False`` (and only logs) when no checkpoint is available.  A checkpoint that
        fails to load is dropped from the ledger (logged) and the next older one is tried.
        """
        return self.checkpoints.rollback(to_step, skip)

    def metrics(self, scores: bool = True) -> dict[str, float]:
        """This step's ``stability/*`` metrics, for any logger (see
        :meth:`~stability.adapters.guard.feedback.GuardFeedback.metrics`)."""
        return self.feedback.metrics(scores)

    # ------------------------------------------------------------------ state
    def _monitor_state(self) -> dict[str, Any] | None:
        if self.monitor is None or not hasattr(self.monitor, "state_dict"):
            return None
        state: dict[str, Any] = self.monitor.state_dict()
        return state

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible guard state (monitor included) with a ``"version"`` key and the mode
        taken (``"sync"``); with a pending step (``sync="deferred"``) its signals, observed
        after a restore; in step mode the control in force."""
        return {
            "version": STATE_VERSION,
            "step": self.step_count,
            "data_position": self.data_position,
            "skip_positions": sorted(self.skip_positions),
            "lr_factor": self.multiplier.factor,
            "lr_multiplier": self.multiplier.state_dict(),
            "interventions": self.tally.state_dict(),
            "monitor": self._monitor_state(),
            "counters": {"amp_overflows": self.amp_overflows,
                         "steps_lost_in_place": self.steps_lost_in_place},
            "goodput": self.goodput.state_dict() if self._own_goodput else None,
            "canary": None if self.canary is None else self.canary.state_dict(),
            **self.sync_path.state_dict(self.control),
        }

    def load_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (fields added later fall back to defaults), from a
        guard of either ``sync`` mode.

        Every field is checked before anything changes (``ValueError`` naming it): the LR
        factor and the multiplier's numbers must be finite and positive, counters and
        positions non-negative ints.  The monitor's part follows
        :meth:`~stability.monitor.monitor.Monitor.load_state_dict` (its config wins;
        ``strict=False`` re-warms incompatible parts with a warning).
        """
        sd = dict(sd)
        section, recorded = self.sync_path.parse(sd)
        state = _check_state(Fields("TorchGuard", sd), self)
        if state.goodput is not None and self._own_goodput:
            GoodputTracker().load_state_dict(state.goodput)  # checked before anything changes
        if state.interventions is not None:
            InterventionTally().load_state_dict(state.interventions)  # checked, changes nothing
        canary = sd.get("canary")
        if canary is not None and self.canary is not None:
            CanarySet(self.canary.loss_fn).load_state_dict(canary)  # checked, changes nothing
        self._load_monitor(state.monitor, strict)  # the last part that can refuse
        if canary is not None and self.canary is not None:
            self.canary.load_state_dict(canary)
        if state.interventions is not None:
            self.tally.load_state_dict(state.interventions)
        self.step_count, self.data_position = state.step, state.position
        self.skip_positions = state.skips
        self.multiplier.factor = state.factor
        if state.multiplier is not None:
            self.multiplier.load_state_dict(state.multiplier)
        self.amp_overflows = state.counters.get("amp_overflows", self.amp_overflows)
        self.steps_lost_in_place = state.counters.get("steps_lost_in_place", 0)
        self._load_goodput(state.goodput, state.counters)
        self.checkpoints.reconcile()
        self.collector.begin_step(self.step_count)
        self.sync_path.load(section, recorded)

    def _load_monitor(self, sd: Any, strict: bool) -> None:
        """Load the monitor's part of a guard snapshot (it checks every field before it
        changes anything: a refused snapshot leaves the monitor as it was)."""
        if sd is None or self.monitor is None:
            return
        if strict:  # (a duck-typed monitor need not know the argument)
            self.monitor.load_state_dict(sd)
        else:
            self.monitor.load_state_dict(sd, strict=False)

    def _load_goodput(self, goodput: Any, counters: Mapping[str, int]) -> None:
        """The guard's own goodput ledger from a snapshot (version-1 snapshots kept the counts
        beside the ledger)."""
        if not self._own_goodput:
            return
        if goodput is not None:
            self.goodput.load_state_dict(goodput)
            return
        for k, v in counters.items():
            if k in _OLD_COUNTERS:
                setattr(self.goodput, _OLD_COUNTERS[k], v)

    @contextlib.contextmanager
    def base_lr(self) -> Iterator[None]:
        """Show the scheduler's own LR in ``param_groups`` inside the block.

        For a scheduler stepped outside the guard (e.g. once per epoch) while an LR cut is
        active, so that a recursive scheduler (``StepLR``, ``ExponentialLR``) computes from its
        own values::

            with guard.base_lr():
                epoch_scheduler.step()
        """
        self.multiplier.restore()
        try:
            yield
        finally:
            self.multiplier.show()

    # ------------------------------------------------------------------ monitor
    def _observe(self, step: int, sig: Signals) -> Decision:
        mon = self.monitor
        if mon is None:
            return Decision(step, control=Control(clip_norm=None))
        if not self._families_declared:
            self._families_declared = True
            self._use_families = hasattr(mon, "declare_family")
            if self._use_families:
                for fam, names in self.collector.layers.items():
                    mon.declare_family(fam, list(names))
        if self._use_families:
            d = mon.observe(step, sig.scalars, families=sig.families)
        else:
            d = mon.observe(step, sig.flat(self.collector.layers))
        return d

    def detach(self) -> None:
        """Observe a pending step (:meth:`flush`), remove every hook this guard installed (and
        stop its watchdog)."""
        self._flush_quietly()
        self.multiplier.remove()
        self.collector.remove()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.record_goodput()

    def record_goodput(self) -> None:
        """Append the goodput ledger's record to the monitor's event log (if it has one).

        Done by the guard at the end of training -- a stop, the end of :meth:`batches`,
        :meth:`detach` (the trainer callbacks call it at the end of ``fit`` / ``train``) -- so
        ``stability goodput EVENTS`` works without ``Monitor.close()``.  Once per step reached.
        """
        if self._goodput_recorded == self.step_count:
            return
        record = getattr(self.monitor, "record_goodput", None)  # scripted monitors lack it
        if record is not None:
            self._goodput_recorded = self.step_count
            record()


#: guard counters of version-1 snapshots -> the goodput ledger's fields
_OLD_COUNTERS = {"steps_skipped": "skipped", "batches_skipped": "batches_skipped",
                 "rollbacks": "rollbacks", "steps_lost": "lost",
                 "checkpoints_taken": "checkpoints", "checkpoint_failures": "checkpoint_failures"}
_COUNTERS = (*_OLD_COUNTERS, "amp_overflows", "steps_lost_in_place")


@dataclasses.dataclass
class _GuardState:
    """A checked guard state (:func:`_check_state`), not yet applied."""

    step: int
    position: int
    skips: set[int]
    factor: float
    multiplier: Any
    counters: dict[str, int]
    goodput: Any
    monitor: Any
    interventions: Any


def _finite_loss(sig: Signals) -> float | None:
    """The step's loss as a float (``None``: not measured)."""
    v = sig.scalars.get("loss")
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def _check_state(f: Fields, guard: TorchGuard) -> _GuardState:
    """Check every field of a guard state (``ValueError`` names a bad one); changes nothing."""
    f.version(STATE_VERSION)
    step = f.integer("step", f.get("step", guard.step_count), lo=0)
    position = f.integer("data_position", f.get("data_position", guard.data_position), lo=0)
    skips = {f.integer(f"skip_positions[{i}]", x, lo=0)
             for i, x in enumerate(f.seq("skip_positions", None, f.get("skip_positions", [])))}
    factor = f.number("lr_factor", f.get("lr_factor", 1.0), lo=0.0, low_open=True)
    mult = f.get("lr_multiplier", None)
    if mult is not None:
        _check_multiplier(f.sub("lr_multiplier"), factor)
    counters = {k: f.integer(f"counters.{k}", v, lo=0)
                for k, v in f.mapping("counters", {}).items() if k in _COUNTERS}
    return _GuardState(step, position, skips, factor, mult, counters, f.get("goodput", None),
                       f.get("monitor", None), f.get("interventions", None))


def _check_multiplier(m: Fields, factor: float) -> None:
    """Check the LR multiplier's numbers: finite, positive (``written`` may hold ``None``)."""
    m.number("factor", m.get("factor", factor), lo=0.0, low_open=True)
    for key, pos in (("base", False), ("written", True), ("written_factor", False)):
        for i, x in enumerate(m.seq(key, None, m.get(key, []))):
            if not (pos and x is None):
                m.number(f"{key}[{i}]", x, lo=0.0, low_open=not pos and key != "base")


def _activation_names(model: torch.nn.Module, activations: Any) -> Any:
    """``activations`` as a ``{name: module}`` mapping (names from ``model.named_modules()``).

    Accepts module names, module objects (``[model.blocks[0], model.blocks[-1]]``), a mix, or a
    mapping (passed through).  Anything not part of ``model`` raises a ``ValueError`` naming it.
    """
    if activations is None or isinstance(activations, Mapping):
        return activations
    if isinstance(activations, (str, torch.nn.Module)):
        activations = [activations]
    mods = dict(model.named_modules())
    names = {id(m): n for n, m in mods.items()}
    out: dict[str, torch.nn.Module] = {}
    for a in activations:
        if isinstance(a, torch.nn.Module):
            name = names.get(id(a))
            if name is None:
                raise ValueError("The 'activations' parameter of TorchGuard got a module that "
                                 f"is not part of the model: {type(a).__name__}.")
            out[name or "model"] = a
        else:
            if str(a) not in mods:
                raise ValueError(f"The 'activations' parameter of TorchGuard names {a!r}, which "
                                 "is not a module of the model (see model.named_modules()).")
            out[str(a) or "model"] = mods[str(a)]
    return out


def make_canary(canary: int | CanarySet | None, loss_fn: LossFn | None, every: int | None,
                checkpoint_every: int) -> CanarySet | None:
    """The guard's canary set from its ``canary`` / ``canary_loss`` / ``canary_every``
    arguments (``None``: off)."""
    if canary is None or isinstance(canary, CanarySet):
        return canary
    if isinstance(canary, bool) or not isinstance(canary, int) or canary < 0:
        raise ValueError("The 'canary' parameter of TorchGuard must be an int in the range "
                         f"[0, inf) or a CanarySet. Got {canary!r} instead.")
    if canary == 0:
        return None
    if loss_fn is None:
        raise ValueError("TorchGuard(canary=K) needs canary_loss=fn(model, batch) -> loss (the "
                         "loop's own loss of a batch).")
    return CanarySet(loss_fn, size=canary,
                     every=every if every is not None else (checkpoint_every or 100))


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
           monitor: Any = None, **kwargs: Any) -> TorchGuard:
    """Create a :class:`TorchGuard` (see its parameters); the one-line entry point."""
    return TorchGuard(model, optimizer, scheduler, monitor, **kwargs)
