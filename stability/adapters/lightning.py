"""PyTorch Lightning callback: the monitor inside ``Trainer(callbacks=[...])``.

Example::

    import lightning as L
    from stability.adapters.lightning import StabilityCallback
    from stability.monitor import Monitor

    trainer = L.Trainer(max_steps=10_000, gradient_clip_val=1.0,
                        callbacks=[StabilityCallback(Monitor("llm_pretrain"))])
    trainer.fit(model, train_loader, val_loader)   # log "val_loss" in validation_step

Hooks used (Lightning 2.x, automatic optimisation, one optimizer):

* ``on_before_backward`` -- the loss of each micro-batch (averaged over gradient accumulation);
* ``on_before_optimizer_step`` -- runs *before* Lightning's own gradient clipping: measures the
  pre-clip gradient norms (global and per layer) and the other signals in one host sync, asks
  the monitor, then acts: the monitor's clip norm is applied to the real gradients, the LR
  multiplier is set (it survives the scheduler, see
  :class:`~stability.adapters.interventions.LRMultiplier`), and a skipped step drops the
  gradients (``p.grad = None``) so the optimizer step changes nothing;
* ``on_train_batch_end`` -- checkpoints, rollback (model, optimizer and scheduler restored in
  place; the dataloader is not rewound, so the batches after the bad ones are simply new data),
  and a stop request sets ``trainer.should_stop`` (the reason is kept in :attr:`stopped`);
* ``on_validation_end`` -- ``trainer.callback_metrics["val_loss"]`` joins the next step's signals;
* ``state_dict`` / ``load_state_dict`` -- the guard and the monitor state travel in Lightning's
  checkpoints (``"version"`` key; fields added later fall back to defaults).

The scheduler is stepped by Lightning even on skipped steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from .interventions import TrainingStopped
from .torch import TorchGuard

__all__ = ["StabilityCallback"]


class StabilityCallback(pl.Callback):
    """Lightning callback that measures, decides and acts through a :class:`TorchGuard`.

    Parameters
    ----------
    monitor : Monitor
        The monitor (its state is saved with Lightning checkpoints).
    val_key : str
        ``trainer.callback_metrics`` key of the validation loss.
    checkpoint_dir : path-like, optional
        Where the guard's own checkpoints go (``None`` = in memory).
    **guard_kwargs
        More :class:`~stability.adapters.torch.TorchGuard` arguments (``checkpoint_every``,
        ``activations``, ``update_ratio_every``, ...).
    """

    def __init__(self, monitor: Any, *, val_key: str = "val_loss",
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 **guard_kwargs: Any) -> None:
        super().__init__()
        self.monitor = monitor
        self.val_key = val_key
        self.checkpoint_dir = checkpoint_dir
        self.guard_kwargs = guard_kwargs
        self.guard: TorchGuard | None = None
        self.stopped: TrainingStopped | None = None
        self._pending_state: Mapping[str, Any] | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._checked = False

    # ------------------------------------------------------------------ setup
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None:
            return
        if len(trainer.optimizers) != 1:
            raise ValueError("StabilityCallback supports exactly one optimizer; got "
                             f"{len(trainer.optimizers)}.")
        cfgs = trainer.lr_scheduler_configs
        sched = cfgs[0].scheduler if cfgs else None
        kw: dict[str, Any] = {"raise_on_stop": False, "checkpoint_dir": self.checkpoint_dir}
        kw.update(self.guard_kwargs)
        self.guard = TorchGuard(pl_module, trainer.optimizers[0], sched, self.monitor, **kw)
        if self._pending_state is not None:
            self.guard.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None:
            self.guard.detach()

    # ------------------------------------------------------------------ per step
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: torch.Tensor) -> None:
        d = loss.detach()
        self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._loss_n += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.guard is None:
            return
        loss = None if self._loss_sum is None else self._loss_sum / max(1, self._loss_n)
        self._loss_sum, self._loss_n = None, 0
        self.guard.check(loss)
        self._checked = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.guard is None or not self._checked:
            return  # an accumulation micro-batch: no optimizer step yet
        self._checked = False
        self.guard.finish()
        if self.guard.stopped is not None and self.stopped is None:
            self.stopped = self.guard.stopped
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is None or trainer.sanity_checking:
            return
        v = trainer.callback_metrics.get(self.val_key)
        if v is not None:
            self.guard.validation(float(v))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self.guard is not None:
            return self.guard.state_dict()
        if self._pending_state is not None:
            return dict(self._pending_state)
        return {"version": 1, "monitor": (self.monitor.state_dict()
                                          if hasattr(self.monitor, "state_dict") else None)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.guard is not None:
            self.guard.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)
