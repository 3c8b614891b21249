"""Guard a plain PyTorch training loop with a :class:`~stability.monitor.Monitor`.

The guard measures the signals itself (one host sync per step), asks the monitor, and carries out
the decision for real: clip, LR multiplier surviving the scheduler, skipped step, emergency
checkpoint, rollback with skipped batches, clean stop (:class:`TrainingStopped`).

Example (index-addressable data, so a rollback can rewind and skip the offending batches)::

    import stability.torch
    from stability.monitor import Monitor

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

Steps: the monitor step is the guard's optimizer-step counter. A rollback to the checkpoint of
step ``s`` sets it back to ``s + 1`` together with the model, optimizer, scheduler and data
position (the monitor's own state is *not* rolled back: it must remember what happened).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._state_check import Fields
from ..feedback import InterventionTally, feedback_metrics, log_interventions
from ..preemption import install_sigterm_checkpoint
from ..types import Control, Decision
from ..watchdog import StallWatchdog
from .amp import AMP_OVERFLOW, LOSS_SCALE, ensure_unscaled, scaler_enabled
from .distributed import ControlSync
from .interventions import (
    CheckpointStore,
    LRMultiplier,
    SavedCheckpoint,
    TrainingStopped,
    clip_gradients,
    drop_gradients,
)
from .signals import SignalCollector, Signals

__all__ = ["TorchGuard", "TrainingStopped", "attach", "find_ledger"]

log = logging.getLogger("stability.adapters")

STATE_VERSION = 1


def find_ledger(monitor: Any) -> Any:
    """The monitor's :class:`~stability.checkpoints.CheckpointLedger`, or ``None``."""
    for name in ("ledger", "checkpoints", "checkpoint_ledger"):
        led = getattr(monitor, name, None)
        if led is not None and hasattr(led, "add"):
            return led
    return None


class TorchGuard:
    """Signals in, decisions out, interventions carried out on real objects.

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
    layer_depth, update_ratio_every, activations, activation_every
        Passed to :class:`~stability.adapters.signals.SignalCollector`.
    update_ratio : {"sampled", "exact"}
        How update ratios are measured: ``"sampled"`` (default) copies no full parameter (about
        4096 elements per tensor; ~1% error with AdamW, a few % with SGD), ``"exact"`` copies
        every parameter when a ratio is due (see :mod:`stability.adapters.signals`).
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
        ``loss_scale`` and *without* gradient norms (see :mod:`stability.adapters.amp`).
    log_interventions : bool
        Log one INFO line per acting intervention on the ``stability.adapters`` logger.
    watchdog : bool or StallWatchdog, optional
        Stall watchdog (:mod:`stability.watchdog`): ``True`` builds one reporting through the
        monitor's sinks and event log (``StallWatchdog.for_monitor``); the guard beats it after
        every step and passes its ``step_time`` (and throughput / MFU when configured) to the
        monitor.  Stopped by :meth:`detach`.
    checkpoint_on_sigterm : bool
        Preemption: on SIGTERM, checkpoint at the end of the current step (never mid-update),
        then hand the signal to the previous handler (default: the process exits).  Main
        thread only (see :mod:`stability.preemption`).
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
        update_ratio_every: int = 1,
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
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError("The 'checkpoint_every' parameter of TorchGuard must be an int in "
                             f"the range [0, inf). Got {checkpoint_every} instead.")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.monitor = monitor
        self.clip_norm = clip_norm
        self.step_scheduler_on_skip = step_scheduler_on_skip
        self.checkpoint_every = int(checkpoint_every)
        self.raise_on_stop = raise_on_stop
        if monitor is not None and hasattr(monitor, "trainer_clip_norm"):
            monitor.trainer_clip_norm = clip_norm  # the policy never loosens the loop's clip
        # the monitor's goodput ledger counts every step from its Control (rollbacks as
        # requested); the guard adds what only it knows: the wall clock, checkpoint save
        # times, and the rollback it really did (which replaces the requested one)
        self.goodput: Any = getattr(monitor, "goodput", None)
        self._goodput("start")
        self.collector = SignalCollector(
            model, layer_depth=layer_depth, update_ratio_every=update_ratio_every,
            activations=_activation_names(model, activations), activation_every=activation_every,
            update_ratio=update_ratio)
        self.multiplier = LRMultiplier(optimizer, scheduler=scheduler)
        self.scaler = scaler if scaler_enabled(scaler) else None
        self.log_interventions = log_interventions
        self.tally = InterventionTally()
        self.amp_overflow = False  # the current step overflowed in the scaler
        self.sync = distributed if isinstance(distributed, ControlSync) else (
            ControlSync() if distributed in (None, True) else None)
        if self.sync is not None and not self.sync.active:
            self.sync = None
        rank = self.sync.rank if self.sync is not None else -1
        # a CheckpointStore, or an adapter's store of the trainer's own checkpoints
        self.store: Any = CheckpointStore(checkpoint_dir, keep=keep_checkpoints, rank=rank,
                                     on_drop=self._forget_checkpoint)
        self.recorder = recorder if rank <= 0 else None
        self.step_count = int(start_step)
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
        # goodput-style counters
        self.steps_skipped = 0
        self.batches_skipped = 0
        self.rollbacks = 0
        self.steps_lost = 0
        self.checkpoints_taken = 0
        self.checkpoint_failures = 0
        self.amp_overflows = 0
        self._recorder_flush_failed = False
        self.interventions: list[Any] = []
        self.collector.begin_step(self.step_count)
        self._sigterm = (install_sigterm_checkpoint(lambda: None, chain=False)
                         if checkpoint_on_sigterm else None)
        self.watchdog: StallWatchdog | None = (
            watchdog if isinstance(watchdog, StallWatchdog)
            else StallWatchdog.for_monitor(self.monitor) if watchdog else None)

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
                self.batches_skipped += 1
                continue
            self._consumed = self._rewound = False
            it += 1
            yield idx
            if not (self._consumed or self._rewound):
                self.data_position = idx + 1

    def should_skip_batch(self, position: int) -> bool:
        """Whether the batch at ``position`` is one a rollback asked to skip."""
        return position in self.skip_positions

    def validation(self, val_loss: float, **metrics: float) -> None:
        """Hand in a validation result; it joins the next step's metrics."""
        self._pending["val_loss"] = float(val_loss)
        self._pending.update({k: float(v) for k, v in metrics.items()})

    # ------------------------------------------------------------------ one step
    def step(self, loss: Any, metrics: Mapping[str, Any] | None = None) -> Decision:
        """Everything after ``loss.backward()``: decide, clip, step, schedule, zero_grad.

        Returns the monitor's :class:`~stability.types.Decision`; raises
        :class:`TrainingStopped` when the monitor stops the run.
        """
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
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.finish()
        self.multiplier.show()  # between steps param_groups show the LR really applied
        if self.watchdog is not None:
            self.watchdog.beat(decision.step)
        return decision

    def collect(self, loss: Any, metrics: Mapping[str, Any] | None = None) -> Signals:
        """Measure this step's signals (one host sync); adds ``lr`` and pending validation."""
        extra: dict[str, Any] = {"lr": self.multiplier.base_lrs()[0]}
        if self.scaler is not None:
            extra.update(self._amp_extra())
        extra.update(self._pending)
        self._pending = {}
        if self.watchdog is not None:
            extra.update(self.watchdog.metrics())
        if metrics:
            extra.update(metrics)
        sig = self.collector.collect(loss, extra)
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
        step = self.step_count
        self._pos_of_step[step] = self.data_position
        while len(self._pos_of_step) > 100_000:
            self._pos_of_step.popitem(last=False)
        sig = signals if signals is not None else self.collect(loss, metrics)
        decision = self._observe(step, sig)
        control = decision.control
        alarmed = bool(decision.alarms)
        if self.sync is not None:
            control, alarmed = self.sync.reduce(control, step, alarmed,
                                                loss=sig.scalars.get("loss"),
                                                grad_norm=sig.scalars.get("grad_norm"))
            ranked = self.sync.rank_alarms
            if ranked and self.sync.rank == 0:  # identical everywhere: rank 0 records them
                report = getattr(self.monitor, "report_alarms", None)  # scripted monitors lack it
                if report is not None:
                    report(step, ranked)
        self.decision, self.control, self.healthy = decision, control, not alarmed
        self.interventions.extend(decision.interventions)
        if decision.interventions:
            self.tally.add(decision)
            if self.log_interventions:
                log_interventions(decision, log)
        if self.recorder is not None:
            self.recorder.log(step, sig.flat(self.collector.layers))
        # act before the optimizer step
        self.multiplier.factor = float(control.lr_factor)
        self.should_step = not (control.skip_step or control.rollback_to is not None
                                or control.stop)
        if self.amp_overflow:
            self.amp_overflows += 1
        if self.should_step and self.amp_overflow:
            # the scaler skips this step itself: nothing to clip, no update to measure
            self.multiplier.restore()
        elif self.should_step:
            norm = _tightest(self.clip_norm, control.clip_norm)
            if norm is not None:
                clip_gradients(self.collector.params, norm, sig.scalars.get("grad_norm"))
            self.collector.before_step(step)
            self.multiplier.apply()  # idempotent; also done by the optimizer pre-hook
        else:
            drop_gradients(self.collector.params)
            self.steps_skipped += 1
        return decision

    def finish(self) -> None:
        """After the optimizer/scheduler step: checkpoints, rollback, stop; advances the step."""
        control, step = self.control, self.step_count
        self.collector.after_step(stepped=self.should_step)
        self._consumed = True
        if control.save_checkpoint:
            # with a rollback in the same decision the ledger was already rewound: the emergency
            # checkpoint (kept for forensics) belongs to the abandoned timeline, so not registered
            self._auto_checkpoint(healthy=False, reason=control.checkpoint_reason or "emergency",
                                  register=control.rollback_to is None)
        if control.stop:
            if control.rollback_to is not None:
                # stop with the last good weights in place (the run cannot be brought back)
                self.rollback(control.rollback_to, None)
            self.stopped = TrainingStopped(
                control.stop_reason or "stop requested", step,
                self.decision.alarms if self.decision else (), self.decision)
            self.step_count += 1
            self.data_position += 1
            if self.raise_on_stop:
                raise self.stopped
            return
        if control.rollback_to is not None and self.rollback(control.rollback_to,
                                                             control.skip_batches):
            self.collector.begin_step(self.step_count)
            return
        if self.checkpoint_every and step % self.checkpoint_every == 0 and self.healthy:
            self._auto_checkpoint(healthy=True, reason="periodic", step=step)
        if self._sigterm is not None and self._sigterm.received is not None:
            self._preempted(step)
        self.step_count += 1
        self.data_position = self._pos_of_step.get(step, self.data_position) + 1
        self.collector.begin_step(self.step_count)
        self.multiplier.show()  # between steps param_groups show the LR really applied

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

    # ------------------------------------------------------------------ feedback
    def metrics(self, scores: bool = True) -> dict[str, float]:
        """This step's ``stability/*`` metrics, for TensorBoard / W&B / any logger.

        :func:`stability.feedback.feedback_metrics` of the latest decision, plus the LR actually
        applied (``stability/lr_effective``), the scheduler's LR (``stability/lr_base``),
        intervention counts by type and the goodput counters (``steps_skipped``, ``rollbacks``,
        ``steps_lost``, ``checkpoints``, ...); with a scaler also ``amp_overflow`` /
        ``loss_scale`` / ``amp_overflows``.

        Examples
        --------
        >>> import torch
        >>> from stability.monitor import Monitor
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = TorchGuard(model, opt, monitor=Monitor("small"), log_interventions=False)
        >>> loss = model(torch.ones(4, 2)).pow(2).mean(); loss.backward(); _ = guard.step(loss)
        >>> m = guard.metrics()
        >>> m["stability/lr_effective"], m["stability/lr_factor"], m["stability/steps_skipped"]
        (0.1, 1.0, 0.0)
        """
        lrs = self.multiplier.base_lrs()
        extra: dict[str, float] = {
            "lr_effective": lrs[0] * self.multiplier.factor if lrs else float("nan"),
            "lr_base": lrs[0] if lrs else float("nan"),
            "steps_skipped": self.steps_skipped,
            "batches_skipped": self.batches_skipped,
            "rollbacks": self.rollbacks,
            "steps_lost": self.steps_lost,
            "checkpoints": self.checkpoints_taken,
            "checkpoint_failures": self.checkpoint_failures,
        }
        extra.update(self.tally.metrics())
        if self.scaler is not None:
            extra["amp_overflow"] = float(self.amp_overflow)
            extra["amp_overflows"] = float(self.amp_overflows)
            try:
                extra["loss_scale"] = float(self.scaler.get_scale())
            except Exception:
                log.debug("could not read the loss scale", exc_info=True)
        try:
            return feedback_metrics(self.monitor, self.decision, extra, scores=scores)
        except Exception:  # feedback must never kill the run
            log.debug("feedback metrics failed", exc_info=True)
            return {f"stability/{k}": float(v) for k, v in extra.items()}

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

    def _monitor_state(self) -> dict[str, Any] | None:
        if self.monitor is None or not hasattr(self.monitor, "state_dict"):
            return None
        return self.monitor.state_dict()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, healthy: bool, reason: str = "", step: int | None = None,
                        register: bool = True) -> SavedCheckpoint:
        """Checkpoint model, optimizer, scheduler, monitor state and data position now.

        The entry is registered in the monitor's checkpoint ledger with its health flag.
        """
        step = self.step_count if step is None else step
        pos = self._pos_of_step.get(step, self.data_position) + 1
        self._flush_recorder()
        t0 = time.monotonic()
        with self.base_lr():  # the optimizer state holds the scheduler's own LR, not the cut
            entry = self.store.save(self.model, self.optimizer, self.scheduler, step=step,
                                    data_position=pos, healthy=healthy, reason=reason,
                                    monitor_state=self._monitor_state(),
                                    protect=self._rollback_targets())
        self._goodput("note_checkpoint", time.monotonic() - t0)
        self.checkpoints_taken += 1
        led = find_ledger(self.monitor) if register else None
        if led is not None:
            try:
                led.add(step, entry.path or f"memory:step-{step}", healthy=healthy,
                        reason=reason, covers_step=step)
            except Exception:  # bookkeeping must never kill the run
                log.exception("could not register checkpoint %s in the ledger", step)
        return entry

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
        led = find_ledger(self.monitor)
        if led is None:
            return set()
        anchors = getattr(getattr(self.monitor, "policy", None), "rollback_anchors", None)
        out = set()
        for at in [*(anchors() if anchors is not None else ()), self.step_count]:
            try:
                rec = led.latest_healthy_before(int(at))
            except Exception:  # bookkeeping must never kill the run
                log.debug("ledger query failed", exc_info=True)
                continue
            if rec is not None:
                out.add(int(rec.step))
        return out

    def _forget_checkpoint(self, step: int) -> None:
        """Retention deleted the checkpoint of ``step``: the ledger must not offer it again."""
        led = find_ledger(self.monitor)
        if led is not None and hasattr(led, "forget"):
            led.forget(step)

    def _auto_checkpoint(self, healthy: bool, reason: str, step: int | None = None,
                         register: bool = True) -> SavedCheckpoint | None:
        """:meth:`save_checkpoint` from :meth:`finish`: a failure never stops training.

        The first failure is logged (once per guard; later ones at debug level), every failure
        is counted in :attr:`checkpoint_failures` and recorded in the monitor's event log.
        """
        try:
            return self.save_checkpoint(healthy=healthy, reason=reason, step=step,
                                        register=register)
        except Exception as exc:  # a full disk, a failing store: training goes on
            self.checkpoint_failures += 1
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

    def rollback(self, to_step: int, skip: tuple[int, int] | None = None) -> bool:
        """Restore the checkpoint of ``to_step`` (or the latest healthy one before it).

        Batches consumed on steps ``skip[0]..skip[1]`` are added to :attr:`skip_positions`.
        Returns ``False`` (and only logs) when no checkpoint is available.
        """
        entry = self.store.entries.get(to_step) or self.store.latest_healthy(to_step)
        if entry is None:
            log.warning("rollback to step %s requested but no checkpoint is available: refused "
                        "(not counted)", to_step)
            if self.monitor is not None and hasattr(self.monitor, "rollback_failed"):
                self.monitor.rollback_failed(self.step_count, f"no checkpoint at or before "
                                                              f"step {to_step}")
            return False
        if skip is not None:
            for s in range(int(skip[0]), int(skip[1]) + 1):
                if s in self._pos_of_step:
                    self.skip_positions.add(self._pos_of_step[s])
        t0 = time.monotonic()
        snap = self.store.restore(entry.step, self.model, self.optimizer, self.scheduler)
        # counted once: replaces the rollback the ledger counted from this step's Control
        self._goodput("rollback_done", self.step_count, entry.step, time.monotonic() - t0)
        issued = self.decision is not None and any(
            getattr(iv, "type", "") == "rollback" for iv in self.decision.interventions)
        if self.monitor is not None and hasattr(self.monitor, "rewind"):
            self.monitor.rewind(entry.step)  # accept steps after entry.step again
        led = find_ledger(self.monitor)
        if not issued and led is not None and hasattr(led, "rewind"):
            led.rewind(entry.step)  # another rank asked: keep this rank's ledger in line
        self.multiplier.restore()
        lost = self.step_count - entry.step
        self.steps_lost += max(lost, 0)
        self.rollbacks += 1
        self.step_count = entry.step + 1
        self.data_position = int(snap.get("data_position", entry.data_position))
        self._rewound = True
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
            "counters": {k: getattr(self, k) for k in _COUNTERS},
        }

    def load_state_dict(self, sd: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (fields added later fall back to defaults).

        Every field is checked before anything changes (``ValueError`` naming it): the LR
        factor and the multiplier's numbers must be finite and positive, counters and
        positions non-negative ints.  The monitor's part follows
        :meth:`~stability.monitor.Monitor.load_state_dict` (its config wins; ``strict=False``
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
        if f.get("monitor", None) is not None and self.monitor is not None:
            if strict:  # (a duck-typed monitor need not know the argument)
                self.monitor.load_state_dict(f.get("monitor"))
            else:
                self.monitor.load_state_dict(f.get("monitor"), strict=False)
        if f.get("interventions", None) is not None:
            self.tally.load_state_dict(f.get("interventions"))
        self.step_count, self.data_position, self.skip_positions = step, position, skips
        self.multiplier.factor = factor
        if mult is not None:
            self.multiplier.load_state_dict(mult)
        for k, v in counters.items():
            setattr(self, k, v)
        self._reconcile_ledger()
        self.collector.begin_step(self.step_count)

    def _reconcile_ledger(self) -> None:
        """After a resume: the ledger lists exactly the checkpoints the store can restore.

        In-memory copies do not survive a restart (their records go); checkpoints on disk that
        the store found again (its index) are registered if the restored ledger lacks them.
        """
        led = find_ledger(self.monitor)
        if led is None or not hasattr(led, "forget") or not isinstance(self.store,
                                                                      CheckpointStore):
            return  # an adapter's trainer store restores its own records
        try:
            have = self.store.entries
            known = {r.step for r in led.records}
            for step in known - set(have):
                led.forget(step)
            for step in sorted(set(have) - known):
                e = have[step]
                led.add(step, e.path or f"memory:step-{step}", healthy=e.healthy,
                        reason=e.reason, covers_step=step)
        except Exception:  # bookkeeping must never kill the run
            log.debug("could not reconcile the checkpoint ledger", exc_info=True)

    def detach(self) -> None:
        """Remove every hook this guard installed (and stop its watchdog)."""
        self.multiplier.remove()
        self.collector.remove()
        if self.watchdog is not None:
            self.watchdog.stop()


_COUNTERS = ("steps_skipped", "batches_skipped", "rollbacks", "steps_lost", "checkpoints_taken",
             "checkpoint_failures", "amp_overflows")


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


def _tightest(a: float | None, b: float | None) -> float | None:
    vals = [v for v in (a, b) if v is not None and math.isfinite(v) and v > 0]
    return min(vals) if vals else None


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
           monitor: Any = None, **kwargs: Any) -> TorchGuard:
    """Create a :class:`TorchGuard` (see its parameters); the one-line entry point."""
    return TorchGuard(model, optimizer, scheduler, monitor, **kwargs)
