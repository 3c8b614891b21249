"""HF Transformers ``TrainerCallback``: the monitor inside ``Trainer(callbacks=[...])``.

Example::

    from transformers import Trainer, TrainingArguments
    from stability.adapters.hf import StabilityTrainerCallback
    from stability.monitor.monitor import Monitor

    args = TrainingArguments("out", max_grad_norm=1.0, save_strategy="steps", save_steps=500)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                      callbacks=[StabilityTrainerCallback(Monitor("finetune"))])
    trainer.train()                                   # or train(resume_from_checkpoint=True)

How it hooks in (transformers 4.4x / 5.x):

* **Clipping.** The Trainer clips *before* ``on_pre_optimizer_step``, which would hide the
  pre-clip gradient norm. With ``take_over_clipping=True`` (default) the callback sets
  ``args.max_grad_norm`` to 0 only between ``on_step_begin`` and ``on_step_end`` (forward,
  backward, optimizer step) and puts the user's value back before anything is logged, evaluated
  or saved, so ``training_args.bin`` and ``trainer.args`` always hold the user's value. In
  ``on_pre_optimizer_step`` it measures the pre-clip norms (global and per layer, one host sync),
  asks the monitor and clips at the tighter of ``max_grad_norm`` and the monitor's clip. (With
  DeepSpeed / FSDP, where the Trainer must clip, pass ``take_over_clipping=False``.)
* **State.** The callback is an :class:`~transformers.trainer_callback.ExportableState`: its
  guard and monitor state are written into every checkpoint's ``trainer_state.json`` and read back
  by ``trainer.train(resume_from_checkpoint=...)`` (warm-ups do not restart; the run goes on with
  the decisions an uninterrupted run would make).
* **Checkpoints.** Rollback targets are the Trainer's own checkpoints (``save_strategy`` /
  ``save_steps``, or every ``checkpoint_every`` steps): each HF save is registered with the
  monitor's checkpoint ledger (the one registry; ``save_total_limit`` rotation is followed, a
  rotated-away directory is never a rollback target), and a rollback restores model, optimizer
  and scheduler from that ``checkpoint-N`` directory. An emergency checkpoint requested by the
  monitor is an ordinary HF save (``control.should_save``), so it resumes with HF's tools. No
  checkpoint is ever written on a step whose weights are non-finite or were just rolled back: a
  save due then is cancelled (logged). In-memory copies only with ``memory_checkpoint_every``,
  bounded by ``memory_limit_mb``.
* **Steps after a rollback.** ``state.global_step`` counts optimizer iterations (HF's budget:
  ``max_steps``, logging, eval and save cadence, checkpoint names) and never goes back. The
  guard's step (the monitor's step, and the position of the restored LR scheduler) goes back to
  the checkpoint's step + 1. Always ``state.global_step == guard.step_count + guard.steps_lost
  - guard.steps_lost_in_place`` (:attr:`StabilityTrainerCallback.guard`; a restore that keeps
  the position, for a fault that recurs at its step, does not move the guard's step back); the
  steps lost to a rollback come out of ``max_steps``, so the schedule does not reach its end.
* **Feedback.** ``on_log`` adds ``stability/*`` keys to HF's training logs (they reach
  ``log_history``, TensorBoard and W&B: the callback moves itself before the reporting callbacks)
  and rewrites ``learning_rate`` to the *effective* LR (scheduler LR x the monitor's factor) while
  a cut is active; ``stability/lr_factor`` says by how much (``stability/lr_base``: the
  scheduler's). Under fp16 with a ``GradScaler`` each logged row carries what the monitor
  observed, so a replay of the log decides as the run did: HF's ``grad_norm`` (measured before
  the callback unscales) is replaced by the callback's unscaled pre-clip norm, and is *missing*
  on a step the scaler skipped (an overflow: the update did not happen -- never a NaN, which a
  replay would take for a fault), and the scaler's ``amp_overflow`` / ``loss_scale`` are logged
  under those names (the monitor's inputs: a replay sees overflows that persist).
  Every acting intervention is logged by the guard (logger ``stability.adapters``, INFO).
* **Sync-free steps.** ``StabilityTrainerCallback(monitor, sync="deferred")`` takes no host sync
  in ``on_pre_optimizer_step``: the guard's ``sync="deferred"`` mode
  (:mod:`stability.adapters.guard.deferred`; decisions act one step late, device-side clip and
  non-finite skip) with the trainer specifics of :mod:`stability.adapters.trainer_deferred`
  (a save step observes its step first; ``state.global_step == guard.step_count +
  guard.steps_lost + guard.voided_steps``; ``train()`` ends by observing the last step).
  The default, ``sync="auto"``, takes it on CUDA with a fused optimizer.
* **Canary set** (on by default, ``canary=4``): a forward pre-hook copies the keyword inputs of
  the first training forward of each of the first healthy steps (no extra dataloader iterator);
  every ``canary_every`` steps the model's own ``.loss`` on them is reported as ``canary_loss``
  (:mod:`stability.adapters.guard.canary`: isolated evaluation, a healthy run is bit-identical
  with and without it).  The batches are saved as ``stability_canary.pt`` in each checkpoint.
* The loss of each micro-batch is captured by a forward hook on the model (``outputs.loss``) and
  averaged over gradient accumulation; ``metrics["eval_loss"]`` from ``on_evaluate`` joins the
  next step's signals. A skipped step drops the gradients (the optimizer changes nothing; the
  scheduler still advances).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, ExportableState

from stability.adapters.guard.canary import CanarySet, LossFn
from stability.adapters.guard.checkpoints import note_goodput
from stability.adapters.interventions import TrainingStopped, safe_torch_load
from stability.adapters.torch_ops.amp import AMP_OVERFLOW, LOSS_SCALE, drop_grad_norms
from stability.adapters.torch_ops.checkpoint_store import restore_state
from stability.adapters.trainer_deferred import (
    TrainerGuard,
    check_sync,
    pending_scalars,
)
from stability.adapters.trainer_support import (
    TrainerCheckpointStore,
    last_step_feedback,
    params_finite,
)
from stability.outputs.feedback import key_selector

__all__ = ["StabilityTrainerCallback", "hf_model_loss", "load_hf_checkpoint"]

log = logging.getLogger("stability.adapters")

STATE_VERSION = 1
#: the canary set's batches, written by the callback into each HF checkpoint directory
CANARY_FILE = "stability_canary.pt"
_LIVE: weakref.WeakSet[StabilityTrainerCallback] = weakref.WeakSet()


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach()
    return None


#: forward keyword arguments the Trainer adds per step, not part of the batch
_NOT_BATCH = ("num_items_in_batch",)


def hf_model_loss(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The canary loss of a captured HF batch: the model's own ``.loss`` of ``model(**batch)``
    (HF models compute it from ``labels``).  Raises when the model returns no loss (the canary
    set then turns itself off with a warning)."""
    loss = _loss_of(model(**batch))
    if loss is None:
        raise ValueError("the model returned no scalar .loss for a captured batch (no labels?"
                         " pass canary_loss=fn(model, batch) or canary=0)")
    return loss


def _logged_inputs(scalars: Mapping[str, Any]) -> dict[str, float]:
    """The monitor's inputs of a step that the trainer log carries: the pre-clip ``grad_norm``
    and the scaler's ``amp_overflow`` / ``loss_scale``.  A step the scaler skipped has no
    gradient norm (missing, as for the monitor: :func:`~stability.adapters.torch_ops.amp.
    drop_grad_norms`).

    >>> _logged_inputs({"grad_norm": float("inf"), "amp_overflow": 1.0, "loss_scale": 8.0})
    {'amp_overflow': 1.0, 'loss_scale': 8.0}
    """
    keep = {k: float(scalars[k]) for k in ("grad_norm", AMP_OVERFLOW, LOSS_SCALE)
            if k in scalars}
    return drop_grad_norms(keep, keep.get(AMP_OVERFLOW, 0.0) > 0.0)


def load_hf_checkpoint(path: str, model: torch.nn.Module, optimizer: Any = None,
                       scheduler: Any = None, scaler: Any = None) -> None:
    """Restore model, optimizer, scheduler (and ``scaler.pt`` if present) in place from an HF
    ``checkpoint-N`` directory: all of them or none.

    Every file is read and checked before anything changes (``RestoreRefused``: weights that do
    not fit the model or are non-finite, an optimizer state of other parameter groups).
    Weights tied to another parameter (``lm_head`` / ``wte``) are absent from HF's files and come
    back with their source; any other missing or unexpected key is refused.
    """
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        sd = load_file(st)
    else:
        sd = safe_torch_load(os.path.join(path, "pytorch_model.bin"))
    parts = {name: safe_torch_load(os.path.join(path, f"{name}.pt"))
             for name, obj in (("optimizer", optimizer), ("scheduler", scheduler),
                               ("scaler", scaler))
             if obj is not None and os.path.exists(os.path.join(path, f"{name}.pt"))}
    restore_state(model, _with_tied_weights(model, sd), optimizer, parts.get("optimizer"),
                  scheduler, parts.get("scheduler"), scaler, parts.get("scaler"), where=path)


def _with_tied_weights(model: torch.nn.Module, sd: Mapping[str, Any]) -> dict[str, Any]:
    """``sd`` plus the tied weights HF leaves out (same storage in the model as a saved key)."""
    named = model.state_dict()
    by_ptr = {named[k].data_ptr(): k for k in sd if k in named}
    full = dict(sd)
    for k, t in named.items():
        if k not in full and t.data_ptr() in by_ptr:
            full[k] = sd[by_ptr[t.data_ptr()]]
    return full


def _callback_handler() -> CallbackHandler | None:
    """The Trainer's :class:`CallbackHandler` that is calling us (found on the call stack)."""
    f: Any = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        owner = f.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
        f = f.f_back
    return None


class StabilityTrainerCallback(TrainerCallback, ExportableState):
    """Measure, decide and act on the Trainer's model, optimizer and scheduler.

    Parameters
    ----------
    monitor : Monitor, optional
        The monitor (default: ``Monitor()`` with the default preset).
    take_over_clipping : bool
        Clip in the callback (pre-clip norms measured) instead of the Trainer.
    checkpoint_every : int
        Ask the Trainer for a checkpoint (``control.should_save``) every this many steps at a
        healthy step, on top of its own ``save_steps`` (0 = only the Trainer's own schedule).
    memory_checkpoint_every : int
        Also keep an in-memory copy every this many healthy steps (0 = never).
    memory_limit_mb : float
        Budget for in-memory copies; a copy that does not fit is refused (logged).
    log_keys : "core", "all" or list of str
        Which ``stability/*`` metrics ``on_log`` adds to HF's logs
        (:func:`stability.outputs.feedback.key_selector`): ``"core"`` (default) the handful of
        :data:`~stability.outputs.feedback.CORE_KEYS`; ``"all"`` also detector scores,
        interventions by type and goodput counters; or a list of names / patterns
        (``["lr_factor", "score/*"]``; ``[]``: none).
    sync : {"auto", "step", "deferred"}
        ``"step"``: one host sync per step in ``on_pre_optimizer_step``, decisions act on their
        own step.  ``"deferred"``: no host sync on the step path (save steps aside), decisions
        act one step late (:mod:`stability.adapters.trainer_deferred`).  ``"auto"`` (default):
        deferred on CUDA with a fused optimizer (``optim="adamw_torch_fused"``), else step,
        resolved at ``on_train_begin`` (``guard.sync_mode``;
        :mod:`stability.adapters.guard.sync_mode`).
    canary : int or CanarySet, optional
        The canary set (:mod:`stability.adapters.guard.canary`): keep this many early healthy
        training batches and report the model's loss on them as ``canary_loss`` every
        ``canary_every`` steps, so that bad data the model memorises is seen without an
        ``eval_dataset``.  **On by default (4 batches)**: the batches are captured by a forward
        pre-hook (a detached copy of the keyword arguments of the first forward of each of the
        first healthy steps, kept on the model's device, at most 8 MiB) -- no extra dataloader
        iterator, the data order and the RNG are the Trainer's -- and evaluated under
        ``no_grad`` in ``eval()`` mode with the RNG forked, so a healthy run trains
        bit-identically with and without it.  ``0`` / ``None``: off.
    canary_loss : callable, optional
        ``canary_loss(model, batch)``; default :func:`hf_model_loss`, the model's own ``.loss``
        (computed from the captured ``labels``).
    canary_every : int, optional
        Steps between canary evaluations (default ``checkpoint_every``, else 100).
    **guard_kwargs
        More :class:`~stability.adapters.torch.TorchGuard` arguments (``activations``,
        ``update_ratio_every``, ``layer_depth``, ``recorder``, ...).

    Attributes
    ----------
    guard : TrainerGuard or None
        The guard acting on the Trainer's objects (created at ``on_train_begin``).
    stopped : TrainingStopped or None
        Why the monitor stopped the run (``control.should_training_stop`` was set).
    cancelled_saves : list of int
        ``state.global_step`` of the saves cancelled because the weights were bad.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> StabilityTrainerCallback:
        # ``restore_callback_states_from_checkpoint=True`` makes HF rebuild callbacks from
        # ``state()["args"]``; give it back the live, not yet started callback instead of a
        # monitor-less copy (the user's monitor, sinks and handlers are kept).
        if kwargs.get("restored_by_trainer"):
            live = [c for c in list(_LIVE) if type(c) is cls and not c._started]
            if len(live) == 1:
                return live[0]
        return super().__new__(cls)

    def __init__(self, monitor: Any = None, *, take_over_clipping: bool = True,
                 checkpoint_every: int = 0, memory_checkpoint_every: int = 0,
                 memory_limit_mb: float = 256.0, restored_by_trainer: bool = False,
                 sync: str = "auto", log_keys: str | list[str] | tuple[str, ...] = "core",
                 canary: int | CanarySet | None = 4, canary_loss: LossFn | None = None,
                 canary_every: int | None = None, **guard_kwargs: Any) -> None:
        if restored_by_trainer and getattr(self, "_initialised", False):
            return  # the live instance handed back by __new__
        if checkpoint_every < 0 or memory_checkpoint_every < 0:
            raise ValueError("The 'checkpoint_every' and 'memory_checkpoint_every' parameters of "
                             "StabilityTrainerCallback must be ints in the range [0, inf). Got "
                             f"{checkpoint_every} and {memory_checkpoint_every} instead.")
        self.sync = check_sync("StabilityTrainerCallback", sync)
        self.log_keys = log_keys
        self._keep = key_selector(log_keys, "log_keys")
        self.monitor = monitor
        self.take_over_clipping = take_over_clipping
        self.checkpoint_every = int(checkpoint_every)
        self.memory_checkpoint_every = int(memory_checkpoint_every)
        self.guard_kwargs = guard_kwargs
        self.canary_kwargs: dict[str, Any] = {
            "canary": canary, "canary_loss": canary_loss or hf_model_loss,
            "canary_every": canary_every or self.checkpoint_every or 100}
        self._canary_hook: Any = None
        self._canary_offered = -1  # the guard step whose batch was last offered
        self.store = TrainerCheckpointStore(
            load_hf_checkpoint, memory_limit_bytes=int(memory_limit_mb * 2**20))
        self.guard: TrainerGuard | None = None
        self.stopped: TrainingStopped | None = None
        self.cancelled_saves: list[int] = []
        self.overhead_s = 0.0
        self.overhead_steps = 0
        self._args: Any = None
        self._user_clip = 0.0
        self._hook: Any = None
        self._losses: list[torch.Tensor] = []
        self._pending_val: float | None = None
        self._last_lr = float("nan")
        self._last_factor = 1.0
        self._last_inputs: dict[str, float] = {}  # the monitor's scaler inputs, last step
        self._checked = False
        self._started = False
        self._global_step = 0
        self._save_reason: str | None = None
        self._save_healthy = True
        self._registered: set[int] = set()
        self._initialised = True
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup / teardown
    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._started = True
        self._args = args
        self._user_clip = float(args.max_grad_norm or 0.0)
        self._place_before_loggers()
        model, opt, sched = kw.get("model"), kw.get("optimizer"), kw.get("lr_scheduler")
        if model is None or opt is None:
            return
        saved = self._saved_state(state) if state.global_step > 0 else None
        if self.monitor is None:
            from stability.monitor.monitor import Monitor

            mon_sd = (saved or {}).get("guard", {}).get("monitor") or {}
            self.monitor = Monitor(mon_sd.get("config"))
        carried = None
        if self.guard is not None:  # a second train() in this process: the run goes on
            carried = self.guard.state_dict()
            self.guard.detach()
        if self._hook is not None:
            self._hook.remove()
        inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
        clip = self._user_clip if self.take_over_clipping and self._user_clip > 0 else None
        kwargs: dict[str, Any] = {"raise_on_stop": False, "clip_norm": clip,
                                  "checkpoint_every": self.memory_checkpoint_every,
                                  "scaler": getattr(opt, "scaler", None),  # fp16 GradScaler
                                  "sync": self.sync, **self.canary_kwargs}
        kwargs.update(self.guard_kwargs)
        self.guard = TrainerGuard(model, inner, sched, self.monitor, **kwargs)
        self._capture_canary(model)
        self.guard.store = self.store  # HF's own checkpoints, recorded in the monitor's ledger
        if saved is not None:
            self._load_canary_batches(args, state)
            self._load(saved, state.global_step)
        elif carried is not None:
            self.guard.load_state_dict(carried)

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if module.training:
                loss = _loss_of(output)
                if loss is not None:
                    self._losses.append(loss)

        self._hook = model.register_forward_hook(hook)

    def _capture_canary(self, model: torch.nn.Module) -> None:
        """Install the forward pre-hook that offers the first training forward of each step to
        the canary set while it fills (removed once it is full or closed)."""
        self._remove_canary_hook()
        canary = self.guard.canary if self.guard is not None else None
        if canary is None or canary.closed or canary.full:
            return

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            guard = self.guard
            if guard is None or guard.canary is None or guard.canary.closed or guard.canary.full:
                self._remove_canary_hook()
                return
            if (not module.training or not torch.is_grad_enabled() or args
                    or self._canary_offered == guard.step_count):
                return  # evaluation, positional inputs, or a later micro-batch of this step
            self._canary_offered = guard.step_count
            guard.offer_batch({k: v for k, v in kwargs.items() if k not in _NOT_BATCH})

        self._canary_hook = model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def _load_canary_batches(self, args: Any, state: Any) -> None:
        """Resume: the canary batches saved with the checkpoint being resumed (if any)."""
        canary = self.guard.canary if self.guard is not None else None
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", CANARY_FILE)
        if canary is None or not os.path.isfile(path) or os.path.islink(path):
            return  # (none: the set refills and rebases, CanarySet.load_state_dict)
        try:
            canary.load_batches(safe_torch_load(path))
        except Exception as exc:  # a bad file must not stop the resume
            log.warning("stability: canary batches in %s not loaded (%s: %s); the set refills",
                        path, type(exc).__name__, exc)

    def _save_canary_batches(self, args: Any, state: Any) -> None:
        """Write the canary batches into the checkpoint HF just wrote (a file of our own)."""
        canary = self.guard.canary if self.guard is not None else None
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if canary is None or not canary.batches or not os.path.isdir(ckpt) or os.path.islink(ckpt):
            return
        path = os.path.join(ckpt, CANARY_FILE)
        if os.path.lexists(path):
            return  # not ours to overwrite
        try:
            torch.save(canary.batches_state(), path)
        except OSError as exc:  # a full disk must not kill the run
            log.warning("stability: canary batches not written to %s (%s)", path, exc)

    def _remove_canary_hook(self) -> None:
        if self._canary_hook is not None:
            self._canary_hook.remove()
            self._canary_hook = None

    def _place_before_loggers(self) -> None:
        """Run right after HF's flow callback, so ``on_log`` edits reach TensorBoard / W&B."""
        handler = _callback_handler()
        if handler is None or self not in handler.callbacks:
            log.info("StabilityTrainerCallback: Trainer callback list not found; stability/* "
                     "keys reach log_history but only the callbacks after this one")
            return
        cbs = handler.callbacks  # moving an item to an earlier index keeps iteration intact
        cbs.remove(self)
        at = next((i + 1 for i, c in enumerate(cbs) if isinstance(c, DefaultFlowCallback)), 0)
        cbs.insert(at, self)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._restore_args()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_canary_hook()
        if self.guard is not None:
            self.guard.detach()  # sync="deferred": observes the last step
            self._note_stop(None)
        record = getattr(self.monitor, "record_goodput", None)  # scripted monitors lack it
        if self.guard is None and record is not None:
            record()  # (a guard records it itself in detach(): the end of training)

    # ------------------------------------------------------------------ per step
    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.guard is not None and self.take_over_clipping and self._user_clip > 0:
            args.max_grad_norm = 0.0  # until on_step_end: nothing is saved in between

    def _restore_args(self) -> None:
        if self._args is not None and self.take_over_clipping and self._user_clip > 0:
            self._args.max_grad_norm = self._user_clip

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.guard is None:
            return
        t0 = time.perf_counter()
        loss = torch.stack(self._losses).mean() if self._losses else None
        self._losses = []
        metrics: dict[str, float] = {}
        if self._pending_val is not None:
            metrics["val_loss"] = self._pending_val
            self._pending_val = None
        if self.guard.deferred is not None:  # no host sync: this step is observed later
            self.guard.check(loss, metrics or None)
        else:
            sig = self.guard.collect(loss, metrics or None)
            self.guard.check(loss, signals=sig)
            self._last_inputs = _logged_inputs(sig.scalars)
        self._checked = True
        self._last_lr = self.guard.multiplier.base_lrs()[0]
        self._last_factor = float(self.guard.multiplier.factor)
        self.overhead_s += time.perf_counter() - t0

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self._restore_args()
        self._global_step = int(state.global_step)
        guard = self.guard
        if guard is None or not self._checked:
            return control
        t0 = time.perf_counter()
        self._checked = False
        # the emergency checkpoint is written below through the trainer's own save, and only
        # if the weights are fine
        emergency, why, rolled = guard.finish_step()
        if guard.deferred is not None and control.should_log and guard.scaler is not None:
            self._last_inputs = _logged_inputs(pending_scalars(guard))  # (HF's log syncs)
        due = bool(self.checkpoint_every) and guard.step_count % self.checkpoint_every == 0
        if control.should_save or emergency or due:
            late, why_late, rolled = guard.observe_before_save()  # deferred: observe this step
            emergency, why = emergency or late, why or why_late
            self._decide_save(control, state, rolled, emergency, why)
        self._note_stop(control)
        self.overhead_s += time.perf_counter() - t0
        self.overhead_steps += 1
        return control

    def _note_stop(self, control: Any) -> None:
        if self.guard is not None and self.guard.stopped is not None and self.stopped is None:
            self.stopped = self.guard.stopped
        if self.stopped is not None and control is not None:
            control.should_training_stop = True

    def _decide_save(self, control: Any, state: Any, rolled: bool, emergency: bool,
                     why: str) -> None:
        guard = self.guard
        assert guard is not None
        bad = "rolled back" if rolled else (
            "" if params_finite(guard.model.parameters()) else "non-finite weights")
        if bad:
            if control.should_save or emergency:
                what = "emergency checkpoint requested" if emergency else "checkpoint due"
                log.warning("stability: %s at trainer step %d not written: %s (the last good "
                            "checkpoint stays the rollback target)", what, state.global_step,
                            "the weights were just rolled back" if rolled else
                            "the weights are non-finite")
                self.cancelled_saves.append(int(state.global_step))
            control.should_save = False
            return
        control.should_save = True
        guard.multiplier.restore()  # optimizer.pt holds the scheduler's LR; shown again on_save
        healthy = guard.healthy and not emergency
        reason = f"emergency: {why}" if emergency else "trainer"
        self._register(state, healthy, reason)

    def _register(self, state: Any, healthy: bool, reason: str) -> None:
        """Register the checkpoint HF writes for this step (before ``state()`` is taken)."""
        guard = self.guard
        if guard is None or self._args is None or state.global_step in self._registered:
            return
        self._registered.add(int(state.global_step))
        path = os.path.join(self._args.output_dir, f"checkpoint-{state.global_step}")
        self.store.add(guard.step_count - 1, path, healthy=healthy, reason=reason)
        note_goodput(guard.goodput, "note_checkpoint", 0.0)  # HF writes it (HF times it)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # saves this callback did not foresee (save_strategy="best", end of training)
        if self.guard is not None and state.global_step not in self._registered:
            emergency, _, rolled = self.guard.observe_before_save()  # deferred: observe first
            if not rolled:  # (a rollback just now: these weights are no rollback target)
                self._register(state, self.guard.healthy and not emergency, "trainer")
            self._note_stop(control)
        self._save_canary_batches(args, state)
        self.store.forget_rotated()  # save_total_limit deleted older checkpoint-N directories
        if self.guard is not None:
            self.guard.multiplier.show()  # between steps the groups show the LR applied

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    **kw: Any) -> None:
        if metrics and "eval_loss" in metrics:
            self._pending_val = float(metrics["eval_loss"])

    # ------------------------------------------------------------------ feedback
    def feedback(self) -> dict[str, float]:
        """The ``stability/*`` metrics added to HF's training logs.

        :meth:`TorchGuard.metrics` (:mod:`stability.outputs.feedback` keys: LR factor, clip, level,
        alarms, detector scores, interventions by type, goodput counters, AMP overflows), with
        ``lr_effective`` / ``lr_base`` / ``lr_factor`` of the *last* optimizer step (what HF's
        ``learning_rate`` refers to) and ``stability/step``, the guard's step.
        """
        return last_step_feedback(self.guard, self._last_lr, self._last_factor)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if not logs:
            return
        if self.guard is None or "learning_rate" not in logs:
            return  # evaluation / summary logs
        extra = {k: v for k, v in self.feedback().items() if self._keep(k)}
        extra["learning_rate"] = float(logs["learning_rate"]) * self._last_factor
        drop = self.guard.scaler is not None and self._last_inputs.get(AMP_OVERFLOW, 0.0) > 0
        if self.guard.scaler is not None:
            extra.update(self._scaler_inputs())
        hist = state.log_history[-1] if state.log_history else None
        for row in (logs, hist if hist is not None and hist is not logs
                    and hist.get("step") == state.global_step else None):
            if row is not None:  # (HF appended its copy to log_history before on_log)
                row.update(extra)
                if drop:
                    row.pop("grad_norm", None)

    def _scaler_inputs(self) -> dict[str, float]:
        """With a loss scaler: what the monitor observed of the last step -- ``amp_overflow``,
        ``loss_scale`` and (when the callback clips) the unscaled pre-clip ``grad_norm`` (HF
        measured its own before the callback unscaled).  On an overflow step ``grad_norm`` is
        absent here and the caller drops HF's (non-finite) value from the row."""
        inputs = dict(self._last_inputs)
        if not (self._user_clip > 0 and self.take_over_clipping):
            inputs.pop("grad_norm", None)  # HF measured it itself (unscaled): keep HF's
        return inputs

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Guard and monitor state (the checkpoint ledger is the monitor's), JSON data."""
        if self.guard is not None:
            guard_sd: dict[str, Any] = self.guard.state_dict()
        else:
            mon = self.monitor
            guard_sd = {"version": 1, "monitor": mon.state_dict() if mon is not None else None}
        return {"version": STATE_VERSION, "guard": guard_sd, "store": self.store.state_dict(),
                "pending_val": self._pending_val, "global_step": self._global_step,
                "registered": sorted(self._registered)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (before or after ``on_train_begin``)."""
        self._load(sd, None)

    def _load(self, sd: Mapping[str, Any], global_step: int | None) -> None:
        saved_gs = int(sd.get("global_step", -1))
        if global_step is not None and saved_gs >= 0 and saved_gs != global_step:
            log.warning("stability: callback state is from trainer step %d, resuming at %d",
                        saved_gs, global_step)
        g = dict(sd.get("guard", {}))
        if self.guard is not None:
            self.guard.load_state_dict(g)
        elif g.get("monitor") is not None and self.monitor is not None:
            self.monitor.load_state_dict(g["monitor"])
        self.store.load_state_dict(sd.get("store", {}))
        pv = sd.get("pending_val")
        self._pending_val = None if pv is None else float(pv)
        self._global_step = max(saved_gs, 0)
        self._registered = set(int(x) for x in sd.get("registered", []))

    def _saved_state(self, state: Any) -> dict[str, Any] | None:
        data = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(data, list):
            data = data[0] if data else None
        if not isinstance(data, Mapping):
            return None
        out = dict(data.get("attributes", {})).get("stability_state")
        return dict(out) if isinstance(out, Mapping) else None

    def state(self) -> dict[str, Any]:
        """``ExportableState``: written into ``trainer_state.json`` with every checkpoint."""
        return {"args": {"restored_by_trainer": True},
                "attributes": {"stability_state": self.state_dict()}}
