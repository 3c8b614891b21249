"""PyTorch Lightning callback: the monitor inside ``Trainer(callbacks=[...])``.

Example::

    import lightning as L
    from stability.adapters.lightning import StabilityCallback
    from stability.monitor.monitor import Monitor

    trainer = L.Trainer(max_steps=10_000, gradient_clip_val=1.0,
                        callbacks=[StabilityCallback(Monitor("llm_pretrain"))])
    trainer.fit(model, train_loader, val_loader)   # log "val_loss" in validation_step
    trainer.fit(model, train_loader, val_loader, ckpt_path="last.ckpt")   # resume: state kept

Hooks used (Lightning 2.x, automatic optimisation, one optimizer):

* ``on_before_backward`` -- the loss of each micro-batch (unscaled again under fp16 AMP, where
  Lightning passes the scaled loss; the mean over gradient accumulation);
* ``on_before_optimizer_step`` -- runs *before* Lightning's own gradient clipping (and after its
  AMP unscale): measures the pre-clip gradient norms (global and per layer) and the other signals
  in one host sync, asks the monitor, then acts: clip, LR multiplier (it survives the scheduler,
  see :class:`~stability.adapters.interventions.LRMultiplier`), skipped step (``p.grad = None``:
  the optimizer step changes nothing). A ``GradScaler`` overflow step is information
  (``amp_overflow``, ``loss_scale``), never a NaN alarm (see
  :mod:`stability.adapters.torch_ops.amp`);
* ``on_train_batch_end`` -- rollback (model, optimizer and scheduler restored in place from one
  of the callback's checkpoints; the dataloader is not rewound: the batches after the bad ones
  are simply new data), checkpoints, a stop request sets ``trainer.should_stop`` (the reason is
  kept in :attr:`StabilityCallback.stopped`), and the ``stability/*`` metrics go to
  ``pl_module.log_dict`` / ``trainer.loggers`` on the steps Lightning logs (every logger: CSV,
  TensorBoard, W&B);
* ``on_validation_end`` -- ``trainer.callback_metrics["val_loss"]`` joins the next step's signals;
* ``on_exception`` -- removes the guard's LR and activation hooks when ``fit`` raises;
* ``state_dict`` / ``load_state_dict`` under :attr:`StabilityCallback.state_key` -- the guard and
  monitor state travel in every Lightning checkpoint, so ``fit(..., ckpt_path=...)`` goes on with
  the decisions of an uninterrupted run.

Checkpoints are Lightning checkpoints written with ``trainer.save_checkpoint`` (they resume with
``ckpt_path=``): every ``checkpoint_every`` healthy steps into ``checkpoint_dir`` (default
``<default_root_dir>/stability-checkpoints``, ``keep_checkpoints`` kept), and an emergency one
when the monitor asks, never on a step whose weights are non-finite or were just rolled back.
In-memory copies only with ``in_memory=True``, bounded by ``memory_limit_mb``.

Sync-free steps: ``StabilityCallback(monitor, sync="deferred")`` takes no host sync in
``on_before_optimizer_step`` -- the guard's ``sync="deferred"`` mode (:mod:`stability.adapters.
deferred`: decisions act one step late, device-side clip and non-finite skip) with the trainer
specifics of :mod:`stability.adapters.trainer_deferred` (a checkpoint step observes its step
first; ``trainer.global_step == guard.step_count + guard.steps_lost + guard.voided_steps``;
``fit`` ends by observing the last step).  The default, ``sync="auto"``, takes it on CUDA with a
fused optimizer (:mod:`stability.adapters.guard.sync_mode`).

Steps after a rollback: ``trainer.global_step`` counts optimizer iterations (Lightning's budget:
``max_steps``, logging and checkpoint cadence) and never goes back; the guard's step (the monitor's
step, and the position of the restored LR scheduler) goes back to the checkpoint's step + 1.
Always ``trainer.global_step == guard.step_count + guard.steps_lost - guard.steps_lost_in_place``
(a restore that keeps the position, for a fault that recurs at its step, does not move the
guard's step or the scheduler back).  The steps lost to a rollback that rewinds are given back:
``max_steps`` grows by them for the rest of ``fit`` (``extend_max_steps``, at most doubling it;
the user's value is back when ``fit`` ends), so the run trains as many healthy steps as it
asked for and the restored scheduler reaches the end of its schedule -- as
:meth:`TorchGuard.batches <stability.adapters.torch.TorchGuard.batches>`, where a rollback costs
iterations, not training.  The scheduler is stepped by Lightning even on skipped steps.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from stability.adapters.guard.canary import CanarySet, LossFn
from stability.adapters.guard.checkpoints import note_goodput
from stability.adapters.interventions import TrainingStopped, safe_torch_load
from stability.adapters.torch_ops.checkpoint_store import (
    CheckpointDirectory,
    RestoreRefused,
    restore_state,
    verify_loadable,
    weights_only_safe,
)
from stability.adapters.trainer_deferred import (
    TrainerGuard,
    check_sync,
)
from stability.adapters.trainer_support import (
    TrainerCheckpointStore,
    last_step_feedback,
    params_finite,
)
from stability.outputs.feedback import CORE_KEYS, key_selector

__all__ = ["StabilityCallback", "load_lightning_checkpoint"]

log = logging.getLogger("stability.adapters")

STATE_VERSION = 2
#: ``stability/*`` keys sent through ``pl_module.log_dict`` (also in ``callback_metrics``): the
#: core keys, so that ``log_keys="core"`` writes one logger row per logged step.
LOG_DICT_KEYS = frozenset(CORE_KEYS)


#: names of the callback's rollback checkpoints in ``checkpoint_dir`` (the only files it deletes)
CHECKPOINT_NAMES = r"(?:emergency-)?step=\d+\.ckpt"


def load_lightning_checkpoint(path: str, model: torch.nn.Module, optimizer: Any = None,
                              scheduler: Any = None, scaler: Any = None) -> None:
    """Restore module weights, the (first) optimizer, scheduler and fp16 loss scaler from a
    Lightning ``.ckpt``: all of them or none (``RestoreRefused``, nothing changed)."""
    ckpt = safe_torch_load(path)
    if not isinstance(ckpt, Mapping) or "state_dict" not in ckpt:
        raise RestoreRefused(f"{path}: not a Lightning checkpoint (no 'state_dict')")
    opts = ckpt.get("optimizer_states") or []
    scheds = ckpt.get("lr_schedulers") or []
    scaler_sd = next((v for k, v in ckpt.items() if k in _SCALER_KEYS and v), None)
    restore_state(model, ckpt["state_dict"], optimizer, opts[0] if opts else None,
                  scheduler, scheds[0] if scheds else None, scaler, scaler_sd, where=str(path))


#: where Lightning keeps the precision plugin's loss scaler state in a checkpoint
_SCALER_KEYS = ("MixedPrecision", "MixedPrecisionPlugin", "native_amp_scaling_state")


def _logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this step's logged metrics (``log_every_n_steps``): building and
    logging ~40 values costs more than the rest of the callback, so only then."""
    conn = getattr(trainer, "_logger_connector", None)
    try:
        return bool(conn.should_update_logs) if conn is not None else True
    except Exception:  # a Lightning without it: log every step
        return True


def _log_step(trainer: pl.Trainer) -> int:
    """The step Lightning writes this batch's ``log_dict`` values at (its optimizer steps
    before this one), so the metrics sent straight to the loggers land in the same row."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return int(step) if isinstance(step, int) else max(int(trainer.global_step) - 1, 0)


def _lost(guard: Any) -> int:
    """Optimizer iterations a rollback rewound the schedule over (lost and voided steps; a
    restore that kept the position did not rewind the scheduler: nothing to give back)."""
    return (int(guard.steps_lost) - int(getattr(guard, "steps_lost_in_place", 0))
            + int(getattr(guard, "voided_steps", 0)))


def _step_budget(trainer: pl.Trainer, guard: Any) -> tuple[int, int] | None:
    """``(max_steps, lost steps not counted in this trainer's global_step)`` at the start of a
    fit, or ``None`` without a step budget.

    A run resumed from a checkpoint counts its earlier lost steps in ``global_step``
    (``global_step == step_count + lost``): they are given back too; a second ``fit`` with a
    new trainer does not count the lost steps of the first one.
    """
    max_steps = int(getattr(trainer.fit_loop.epoch_loop, "max_steps", -1))
    if max_steps <= 0:
        return None
    lost = _lost(guard)
    counted = max(0, min(lost, int(trainer.global_step) - int(guard.step_count)))
    return max_steps, lost - counted


def _give_back_lost_steps(trainer: pl.Trainer, guard: Any,
                          budget: tuple[int, int] | None) -> None:
    """After a rollback: ``max_steps`` = the budget asked + the steps lost in this trainer
    (at most twice the budget asked)."""
    if budget is None:
        return
    asked, not_ours = budget
    extra = min(asked, max(0, _lost(guard) - not_ours))
    trainer.fit_loop.epoch_loop.max_steps = asked + extra


def _restore_budget(trainer: pl.Trainer, budget: tuple[int, int] | None) -> None:
    """The end of ``fit``: ``max_steps`` back to the budget the user asked for (the Trainer's
    settings come out of a run unchanged)."""
    if budget is not None:
        trainer.fit_loop.epoch_loop.max_steps = budget[0]


class StabilityCallback(pl.Callback):
    """Lightning callback that measures, decides and acts through a :class:`TorchGuard`.

    Parameters
    ----------
    monitor : Monitor, optional
        The monitor (its state is saved with Lightning checkpoints); default ``Monitor()``.
    val_key : str
        ``trainer.callback_metrics`` key of the validation loss.
    checkpoint_dir : path-like, optional
        Where the rollback checkpoints go (default ``<default_root_dir>/stability-checkpoints``).
    checkpoint_every : int
        Write a rollback checkpoint after every this many steps (steps ``N-1, 2N-1, ...``, as
        ``every_n_train_steps``), if the step is healthy (0 = never).
    keep_checkpoints : int
        How many periodic rollback checkpoints to keep (the newest healthy one always stays).
    in_memory : bool
        Keep the rollback checkpoints as in-memory copies instead of files.
    memory_limit_mb : float
        Budget for in-memory copies (a copy that does not fit is refused and logged).
    log_keys : "core", "all" or list of str
        Which ``stability/*`` metrics go to the loggers on the steps Lightning logs
        (:func:`stability.outputs.feedback.key_selector`): ``"core"`` (default) the handful of
        :data:`~stability.outputs.feedback.CORE_KEYS`; ``"all"`` also detector scores,
        interventions by type and goodput counters; or a list of names / patterns
        (``["lr_factor", "score/*"]``).  Keys of :data:`LOG_DICT_KEYS` go through
        ``pl_module.log_dict`` (so they are in ``callback_metrics``), the others straight to
        ``trainer.loggers`` at the same step (``log_dict`` costs O(keys^2) per call).
    log_metrics : bool
        ``False``: log no ``stability/*`` metric at all (``"all"``, the old spelling of
        ``log_keys="all"``, is still accepted).
    sync : {"auto", "step", "deferred"}
        ``"step"``: one host sync per step in ``on_before_optimizer_step``.  ``"deferred"``: none
        on the step path (save steps aside), decisions act one step late
        (:mod:`stability.adapters.trainer_deferred`).  ``"auto"`` (default): deferred on CUDA
        with a fused optimizer, else step, resolved at ``on_train_start`` (``guard.sync_mode``).
    extend_max_steps : bool
        ``True`` (default): the steps a rollback throws away (and, with ``sync="deferred"``, the
        step it voids) are added to the trainer's ``max_steps`` when it has one, at most the
        original ``max_steps`` in all: a 41-step rollback near the end of a cosine schedule
        otherwise ends the run 41 updates short of the schedule's end.  ``False``: they come
        out of ``max_steps``.
    canary : int or CanarySet, optional
        The canary set (:mod:`stability.adapters.guard.canary`): keep this many early healthy
        training batches (a detached copy of the ``batch`` of ``on_train_batch_start``, kept on
        its device, at most 8 MiB) and report ``canary_loss(module, batch)`` on them every
        ``canary_every`` steps, so that bad data the model memorises is seen without a
        validation set.  Needs ``canary_loss``: Lightning's ``training_step`` has side effects
        (``self.log``, counters), so it is never called implicitly.  Off by default.
    canary_loss : callable, optional
        ``canary_loss(module, batch)``: the loss of a batch, for example
        ``lambda m, b: F.cross_entropy(m(b[0]), b[1])``.  Evaluated under ``no_grad`` in
        ``eval()`` mode with the RNG forked (a healthy run trains bit-identically).
    canary_every : int, optional
        Steps between canary evaluations (default ``checkpoint_every``, else 100).
    **guard_kwargs
        More :class:`~stability.adapters.torch.TorchGuard` arguments (``activations``,
        ``update_ratio_every``, ``layer_depth``, ...).

    Attributes
    ----------
    guard : TrainerGuard or None
    stopped : TrainingStopped or None
        Why the monitor stopped the run (``trainer.should_stop`` was set).
    cancelled_saves : list of int
        ``trainer.global_step`` of checkpoints not written because the weights were bad.
    """

    def __init__(self, monitor: Any = None, *, val_key: str = "val_loss",
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 checkpoint_every: int = 100, keep_checkpoints: int = 2,
                 in_memory: bool = False, memory_limit_mb: float = 256.0,
                 log_metrics: bool | str = True, sync: str = "auto",
                 log_keys: str | list[str] | tuple[str, ...] = "core",
                 extend_max_steps: bool = True, canary: int | CanarySet | None = None,
                 canary_loss: LossFn | None = None, canary_every: int | None = None,
                 **guard_kwargs: Any) -> None:
        super().__init__()
        if checkpoint_every < 0:
            raise ValueError("The 'checkpoint_every' parameter of StabilityCallback must be an "
                             f"int in the range [0, inf). Got {checkpoint_every} instead.")
        self.sync = check_sync("StabilityCallback", sync)
        self.monitor = monitor
        self.val_key = val_key
        self.checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        self.checkpoint_every = int(checkpoint_every)
        self.in_memory = in_memory
        if log_metrics == "all":  # the old spelling of log_keys="all"
            log_keys, log_metrics = "all", True
        self.log_metrics = bool(log_metrics)
        self.log_keys = log_keys
        self._keep = key_selector(log_keys, "log_keys")
        self.guard_kwargs = guard_kwargs
        if canary and not isinstance(canary, CanarySet) and canary_loss is None:
            raise ValueError("StabilityCallback(canary=K) needs canary_loss=fn(module, batch) -> "
                             "loss (Lightning's training_step is never called implicitly).")
        self.canary_kwargs: dict[str, Any] = {
            "canary": canary, "canary_loss": canary_loss,
            "canary_every": canary_every or self.checkpoint_every or 100}
        self.store = TrainerCheckpointStore(
            load_lightning_checkpoint, keep=keep_checkpoints,
            memory_limit_bytes=int(memory_limit_mb * 2**20) if in_memory else 0)
        self.guard: TrainerGuard | None = None
        self.stopped: TrainingStopped | None = None
        self.cancelled_saves: list[int] = []
        self.overhead_s = 0.0  # measuring and deciding (check + finish)
        self.overhead_steps = 0
        self.io_s = 0.0  # checkpoint writes and logging through Lightning
        self._trainer: pl.Trainer | None = None
        self._pending_state: Mapping[str, Any] | None = None
        self._pending_val: float | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._checked = False
        self._last_lr = math.nan
        self._last_factor = 1.0
        self._rollback_save = False  # trainer.save_checkpoint is writing a rollback target
        self._converted_warned = False
        self.extend_max_steps = bool(extend_max_steps)
        self._budget: tuple[int, int] | None = None  # (max_steps asked, lost steps not ours)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(val_key=self.val_key)

    # ------------------------------------------------------------------ setup / teardown
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("StabilityCallback supports exactly one optimizer; got "
                             f"{len(trainer.optimizers)}.")
        self._trainer = trainer
        if self.monitor is None:
            from stability.monitor.monitor import Monitor

            mon_sd = dict((self._pending_state or {}).get("guard", {})).get("monitor") or {}
            self.monitor = Monitor(mon_sd.get("config"))
        if self.checkpoint_dir is None:
            self.checkpoint_dir = os.path.join(trainer.default_root_dir, "stability-checkpoints")
        if not self.in_memory:  # one run per directory; only its own names are ever deleted
            self.store.own_directory(CheckpointDirectory(
                self.checkpoint_dir, CHECKPOINT_NAMES,
                f".stability-lock-rank{int(getattr(trainer, 'global_rank', 0))}"))
        carried = None
        if self.guard is not None:  # a second fit() in this process: the run goes on
            carried = self.state_dict()
            self.guard.detach()
        cfgs = trainer.lr_scheduler_configs
        sched = cfgs[0].scheduler if cfgs else None
        kw: dict[str, Any] = {
            "raise_on_stop": False,
            "checkpoint_every": self.checkpoint_every if self.in_memory else 0,
            "scaler": getattr(trainer.precision_plugin, "scaler", None), "sync": self.sync,
            **self.canary_kwargs}
        kw.update(self.guard_kwargs)
        self.guard = TrainerGuard(pl_module, trainer.optimizers[0], sched, self.monitor, **kw)
        self.guard.store = self.store  # the same interface, recorded in the monitor's ledger
        state = self._pending_state if self._pending_state is not None else carried
        self._pending_state = None
        if state is not None:
            self._load(state)
        self._budget = _step_budget(trainer, self.guard)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.store.close()  # the checkpoint directory is free for the next run
        _restore_budget(trainer, self._budget)
        if self.guard is not None:
            self.guard.detach()  # sync="deferred": observes the last step
            if self.guard.stopped is not None and self.stopped is None:
                self.stopped = self.guard.stopped
        record = getattr(self.monitor, "record_goodput", None)  # scripted monitors lack it
        if self.guard is None and record is not None:
            record()  # (a guard records it itself in detach(): the end of training)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """``fit`` raised: remove the LR and activation hooks (nothing of ours stays installed)."""
        _restore_budget(trainer, self._budget)
        if self.guard is not None:
            self.guard.detach()
        self._loss_sum, self._loss_n, self._checked = None, 0, False

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """Offer the first micro-batch of each step to the canary set while it fills."""
        guard = self.guard
        if guard is None or guard.canary is None or guard.canary.closed or guard.canary.full:
            return
        if batch_idx % max(1, trainer.accumulate_grad_batches) == 0:
            guard.offer_batch(batch)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        d = loss.detach()
        scaler = self.guard.scaler if self.guard is not None else None
        if scaler is not None:  # Lightning hands the hook the scaled loss under fp16 AMP
            scale = getattr(scaler, "_scale", None)
            d = d / (scale if isinstance(scale, torch.Tensor) else scaler.get_scale())
        self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._loss_n += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.guard is None:
            return
        t0 = time.perf_counter()
        loss = None
        if self._loss_sum is not None:  # each micro-batch loss was divided by the accumulation
            loss = self._loss_sum * (trainer.accumulate_grad_batches / max(1, self._loss_n))
        self._loss_sum, self._loss_n = None, 0
        metrics: dict[str, float] = {}
        if self._pending_val is not None:
            metrics["val_loss"] = self._pending_val
            self._pending_val = None
        self.guard.check(loss, metrics or None)
        self._checked = True
        self._last_lr = self.guard.multiplier.base_lrs()[0]
        self._last_factor = float(self.guard.multiplier.factor)
        self.overhead_s += time.perf_counter() - t0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        guard = self.guard
        if guard is None or not self._checked:
            return  # an accumulation micro-batch: no optimizer step yet
        t0 = time.perf_counter()
        self._checked = False
        # the emergency checkpoint is written below through the trainer's own save, and only
        # if the weights are fine
        emergency, why, rolled = guard.finish_step()
        step = guard.step_count - 1  # the step the weights now cover (unless rolled back)
        due = (not self.in_memory and self.checkpoint_every > 0
               and (step + 1) % self.checkpoint_every == 0 and guard.stopped is None)
        if due or emergency:  # sync="deferred": observe this step first (its health)
            late, why_late, rolled = guard.observe_before_save()
            emergency, why = emergency or late, why or why_late
        due = due and guard.healthy and guard.stopped is None
        if self.extend_max_steps:  # (a rollback in finish_step or observe_before_save)
            _give_back_lost_steps(trainer, guard, self._budget)
        if guard.stopped is not None and self.stopped is None:
            self.stopped = guard.stopped
            trainer.should_stop = True
        self.overhead_s += time.perf_counter() - t0
        self.overhead_steps += 1
        t0 = time.perf_counter()
        if emergency or due:
            self._save(trainer, step, rolled, emergency, why)
        if self.log_metrics and trainer.logger is not None and _logs_this_step(trainer):
            self._log(trainer, pl_module)
        self.io_s += time.perf_counter() - t0

    def _save(self, trainer: pl.Trainer, step: int, rolled: bool, emergency: bool,
              why: str) -> None:
        guard = self.guard
        assert guard is not None
        bad = "rolled back" if rolled else (
            "" if params_finite(guard.model.parameters()) else "non-finite weights")
        if bad:
            what = "emergency checkpoint requested" if emergency else "checkpoint due"
            log.warning("stability: %s at trainer step %d not written: %s (the last good "
                        "checkpoint stays the rollback target)", what, trainer.global_step,
                        "the weights were just rolled back" if rolled else
                        "the weights are non-finite")
            self.cancelled_saves.append(int(trainer.global_step))
            return
        assert self.checkpoint_dir is not None
        name = f"emergency-step={step}.ckpt" if emergency else f"step={step}.ckpt"
        path = os.path.join(self.checkpoint_dir, name)
        healthy = guard.healthy and not emergency
        reason = f"emergency: {why}" if emergency else "periodic"
        guard.multiplier.restore()  # the file holds the scheduler's own LR
        t0 = time.monotonic()
        self._rollback_save = True
        try:
            trainer.save_checkpoint(path)
        except Exception as exc:  # a full disk must not kill the run
            note_goodput(guard.goodput, "note_checkpoint_failed")
            log.warning("stability: checkpoint %s failed (%s: %s); training continues", path,
                        type(exc).__name__, exc)
            return
        finally:
            self._rollback_save = False
            guard.multiplier.show()
        note_goodput(guard.goodput, "note_checkpoint", time.monotonic() - t0)
        if self._verified(path):
            self.store.add(step, path, healthy=healthy, reason=reason, owned=not emergency,
                           protect=guard.checkpoints.rollback_targets())

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A rollback checkpoint is written in a form ``weights_only=True`` loads: hyper-
        parameters such as an ``argparse.Namespace``, a ``pathlib.Path`` or a NumPy scalar are
        stored as plain data (the user is told once, at the first such checkpoint)."""
        if not self._rollback_save:
            return  # the user's own checkpoints are left exactly as Lightning writes them
        converted: list[str] = []
        for key in list(checkpoint):
            checkpoint[key], conv = weights_only_safe(checkpoint[key], str(key))
            converted += conv
        if converted and not self._converted_warned:
            self._converted_warned = True
            log.warning(
                "stability: the rollback checkpoints hold values torch.load(weights_only=True) "
                "refuses (%s%s); they are stored as plain data (dict / str / number) in the "
                "rollback checkpoints in %s so a rollback can load them. Your own checkpoints "
                "are unchanged.", ", ".join(converted[:6]),
                f" and {len(converted) - 6} more" if len(converted) > 6 else "",
                self.checkpoint_dir)

    def _verified(self, path: str) -> bool:
        """The rollback checkpoint just written loads with ``weights_only=True`` (checked when
        this rank can see the file); if not, it is never a rollback target and the user is
        told at once."""
        if not os.path.exists(path):
            return True  # written by rank 0 elsewhere: rank 0 checks it
        why = verify_loadable(path)
        if why is None:
            return True
        log.error("stability: rollback checkpoint %s cannot be loaded with weights_only=True "
                  "(%s): it is not a rollback target, so a fault cannot be rolled back. Keep "
                  "non-tensor objects out of the checkpoint (on_save_checkpoint) or allow their "
                  "types with torch.serialization.add_safe_globals.", path, why)
        if self.store.owned is not None:
            self.store.owned.delete(path)
        return False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is None or trainer.sanity_checking:
            return
        v = trainer.callback_metrics.get(self.val_key)
        if v is not None:
            self._pending_val = float(v)

    # ------------------------------------------------------------------ feedback
    def feedback(self) -> dict[str, float]:
        """The ``stability/*`` metrics logged every step (:meth:`TorchGuard.metrics`), with the
        LR and factor of the last optimizer step and ``stability/step`` (the guard's step)."""
        return last_step_feedback(self.guard, self._last_lr, self._last_factor)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: v for k, v in self.feedback().items() if self._keep(k)}
        core = {k: v for k, v in metrics.items() if k in LOG_DICT_KEYS}
        if core:
            pl_module.log_dict(core, on_step=True, on_epoch=False)
        rest = {k: v for k, v in metrics.items() if k not in LOG_DICT_KEYS}
        if rest:
            step = _log_step(trainer)
            for lg in trainer.loggers:  # straight to the loggers: log_dict is O(keys^2)
                lg.log_metrics(rest, step=step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Guard and monitor state (the checkpoint ledger is the monitor's), ``"version"`` key."""
        if self.guard is not None:
            guard_sd: dict[str, Any] = self.guard.state_dict()
        elif self._pending_state is not None:
            return dict(self._pending_state)
        else:
            mon = self.monitor
            guard_sd = {"version": 1, "monitor": (mon.state_dict()
                                                  if hasattr(mon, "state_dict") else None)}
        out = {"version": STATE_VERSION, "guard": guard_sd, "store": self.store.state_dict(),
               "pending_val": self._pending_val}
        canary = self.guard.canary if self.guard is not None else None
        if canary is not None and canary.batches:  # tensors: a Lightning checkpoint holds them
            out["canary_batches"] = canary.batches_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.guard is not None:
            self._load(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def _load(self, sd: Mapping[str, Any]) -> None:
        assert self.guard is not None
        if "guard" not in sd:  # version 1: the guard's own state dict
            sd = {"guard": sd}
        batches = sd.get("canary_batches")
        if batches is not None and self.guard.canary is not None:
            self.guard.canary.load_batches(batches)  # before its state: no rebase
        self.guard.load_state_dict(dict(sd["guard"]))
        self.store.load_state_dict(sd.get("store", {}))
        pv = sd.get("pending_val")
        self._pending_val = None if pv is None else float(pv)
