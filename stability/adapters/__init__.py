"""Trainer adapters: plain PyTorch, Lightning, HF Transformers, and torch.distributed.

Every submodule imports its framework, so nothing here is imported eagerly: ``import
stability.adapters`` works without torch, and the names below load their module on first use.

=============================  =================================================
name                           module
=============================  =================================================
``attach``, ``TorchGuard``     :mod:`stability.adapters.torch`
``TrainingStopped``            :mod:`stability.adapters.interventions`
``LRMultiplier``               :mod:`stability.adapters.interventions`
``SignalCollector``            :mod:`stability.adapters.torch_ops.signals`
``StabilityCallback``          :mod:`stability.adapters.lightning`
``StabilityTrainerCallback``   :mod:`stability.adapters.hf`
``ControlSync``, ``RankSignals``  :mod:`stability.adapters.distributed`
``register_local_grad_norm_hook``  :mod:`stability.adapters.distributed`
=============================  =================================================
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "attach": "torch",
    "TorchGuard": "torch",
    "TrainingStopped": "interventions",
    "LRMultiplier": "interventions",
    "CheckpointStore": "interventions",
    "clip_gradients": "interventions",
    "drop_gradients": "interventions",
    "save_checkpoint": "interventions",
    "load_checkpoint": "interventions",
    "SignalCollector": "signals",
    "StabilityCallback": "lightning",
    "StabilityTrainerCallback": "hf",
    "ControlSync": "distributed",
    "RankSignals": "distributed",
    "register_local_grad_norm_hook": "distributed",
    "is_rank_zero": "distributed",
    "safe_torch_load": "interventions",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'stability.adapters' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
