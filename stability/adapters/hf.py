"""HF Transformers ``TrainerCallback``: the monitor inside ``Trainer(callbacks=[...])``.

Example::

    from transformers import Trainer, TrainingArguments
    from stability.adapters.hf import StabilityTrainerCallback
    from stability.monitor import Monitor

    trainer = Trainer(model=model, args=TrainingArguments("out", max_grad_norm=1.0),
                      train_dataset=train, eval_dataset=val,
                      callbacks=[StabilityTrainerCallback(Monitor("finetune"))])
    trainer.train()

How it hooks in (transformers 4.4x / 5.x):

* The Trainer clips gradients *before* ``on_pre_optimizer_step``, so the callback takes clipping
  over (``take_over_clipping=True``, default): at ``on_train_begin`` it keeps
  ``args.max_grad_norm`` and sets it to 0; in ``on_pre_optimizer_step`` it measures the
  **pre-clip** gradient norms (global and per layer, fused, one host sync), asks the monitor and
  clips the real gradients at the tighter of ``max_grad_norm`` and the monitor's clip. (With
  DeepSpeed / FSDP, where the Trainer must clip, pass ``take_over_clipping=False``: norms are
  then post-clip and ``logs["grad_norm"]`` from ``on_log`` is the pre-clip reference.)
* The loss of each micro-batch is captured by a forward hook on the model (``outputs.loss``),
  averaged over gradient accumulation.
* A skipped step drops the gradients (the optimizer step changes nothing); the scheduler still
  advances. The LR multiplier survives the scheduler (optimizer step pre/post hooks).
* ``on_step_end``: checkpoints and rollback (model, optimizer, scheduler restored in place), and
  the monitor's requests mapped onto ``TrainerControl``: ``should_save`` for an emergency
  checkpoint, ``should_training_stop`` for a stop (reason in :attr:`stopped`).
* ``on_evaluate``: ``metrics["eval_loss"]`` joins the next step's signals.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import TrainerCallback

from .interventions import TrainingStopped
from .torch import TorchGuard

__all__ = ["StabilityTrainerCallback"]


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach()
    return None


class StabilityTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Measure, decide and act on the Trainer's model, optimizer and scheduler.

    Parameters
    ----------
    monitor : Monitor
    take_over_clipping : bool
        Clip in the callback (pre-clip norms measured) instead of the Trainer.
    checkpoint_dir : path-like, optional
        Where the guard's own rollback checkpoints go (``None`` = in memory).
    **guard_kwargs
        More :class:`~stability.adapters.torch.TorchGuard` arguments.
    """

    def __init__(self, monitor: Any, *, take_over_clipping: bool = True,
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 **guard_kwargs: Any) -> None:
        self.monitor = monitor
        self.take_over_clipping = take_over_clipping
        self.checkpoint_dir = checkpoint_dir
        self.guard_kwargs = guard_kwargs
        self.guard: TorchGuard | None = None
        self.stopped: TrainingStopped | None = None
        self.last_logged_grad_norm: float | None = None
        self._hook: Any = None
        self._losses: list[torch.Tensor] = []
        self._checked = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model, opt, sched = kw.get("model"), kw.get("optimizer"), kw.get("lr_scheduler")
        if model is None or opt is None:
            return
        clip = None
        if self.take_over_clipping and args.max_grad_norm and args.max_grad_norm > 0:
            clip = float(args.max_grad_norm)
            args.max_grad_norm = 0.0
        inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
        kwargs: dict[str, Any] = {"raise_on_stop": False, "checkpoint_dir": self.checkpoint_dir,
                  "clip_norm": clip}
        kwargs.update(self.guard_kwargs)
        self.guard = TorchGuard(model, inner, sched, self.monitor, **kwargs)

        def hook(module: Any, inputs: Any, output: Any) -> None:
            if module.training:
                loss = _loss_of(output)
                if loss is not None:
                    self._losses.append(loss)

        self._hook = model.register_forward_hook(hook)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.guard is None:
            return
        loss = torch.stack(self._losses).mean() if self._losses else None
        self._losses = []
        self.guard.check(loss)
        self._checked = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self.guard is None or not self._checked:
            return control
        self._checked = False
        ctl = self.guard.control
        self.guard.finish()
        if ctl.save_checkpoint:
            control.should_save = True
        if self.guard.stopped is not None and self.stopped is None:
            self.stopped = self.guard.stopped
        if self.stopped is not None:
            control.should_training_stop = True
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None,
                    **kw: Any) -> None:
        if self.guard is not None and metrics and "eval_loss" in metrics:
            self.guard.validation(float(metrics["eval_loss"]))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "grad_norm" in logs:
            self.last_logged_grad_norm = float(logs["grad_norm"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.guard is not None:
            self.guard.detach()

    def state_dict(self) -> dict[str, Any]:
        """Guard and monitor state (``"version"`` key)."""
        if self.guard is not None:
            return self.guard.state_dict()
        return {"version": 1, "monitor": self.monitor.state_dict()}
