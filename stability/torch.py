"""``stability.torch``: guard a plain PyTorch loop in one line.

Importing this module imports torch (``import stability`` alone never does)::

    import stability.torch
    guard = stability.torch.attach(model, optimizer, scheduler, monitor, checkpoint_dir="ckpt")
    for i in guard.batches(n_batches):
        loss = loss_fn(model(x[i]), y[i]); loss.backward()
        guard.step(loss)

See :mod:`stability.adapters.torch` for the full description.
"""

from __future__ import annotations

from stability.adapters.interventions import (
    CheckpointStore,
    LRMultiplier,
    TrainingStopped,
    clip_gradients,
    drop_gradients,
    load_checkpoint,
    save_checkpoint,
)
from stability.adapters.torch import TorchGuard, attach
from stability.adapters.torch_ops.signals import SignalCollector, Signals

__all__ = [
    "CheckpointStore",
    "LRMultiplier",
    "SignalCollector",
    "Signals",
    "TorchGuard",
    "TrainingStopped",
    "attach",
    "clip_gradients",
    "drop_gradients",
    "load_checkpoint",
    "save_checkpoint",
]
