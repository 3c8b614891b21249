"""Collection rules: modules of optional extras are skipped (not errors) when the extra is absent.

``python -m pytest`` must work after ``pip install -e ".[dev]"`` alone: the doctests of the torch,
Lightning and HF adapters, and tests importing them, skip cleanly without those packages.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# The suite compiles kernels on first use (as `stability warmup` does), so every test sees the
# compiled kernels and the fused driver from its first step whatever the state of the Numba
# cache; the default cold-start mode (interpreted twins while a child process compiles) is
# tested explicitly in tests/test_coldstart.py, which sets its modes itself.
os.environ.setdefault("STABILITY_COLD_START", "blocking")

_ROOT = Path(__file__).resolve().parent


def _missing(*names: str) -> bool:
    return any(importlib.util.find_spec(n) is None for n in names)


#: module path (relative to the root) -> extras it needs
_NEEDS = {
    "stability/adapters/distributed.py": ("torch",),
    "stability/adapters/hf.py": ("torch", "transformers"),
    "stability/adapters/interventions.py": ("torch",),
    "stability/adapters/lightning.py": ("torch", "lightning"),
    "stability/adapters/torch_ops/signals.py": ("torch",),
    "stability/adapters/torch.py": ("torch",),
    "stability/adapters/trainer_support.py": ("torch",),
    "stability/adapters/torch_ops/amp.py": ("torch",),
    "stability/adapters/torch_ops/checkpoint_store.py": ("torch",),
    "stability/adapters/guard/checkpoints.py": ("torch",),
    "stability/adapters/guard/feedback.py": ("torch",),
    "stability/testing/faults.py": ("torch",),
    "stability/testing/models.py": ("torch",),
    "stability/testing/tasks.py": ("torch",),
    "stability/testing/tinytrain.py": ("torch",),
    "stability/torch.py": ("torch",),
}

collect_ignore = [p for p, mods in _NEEDS.items() if (_ROOT / p).exists() and _missing(*mods)]
