"""The task shared by ``field_hf.py`` and ``field_lightning.py``: a fixed random teacher
(``y = argmax(W x)``) learnt by a small MLP, a warm-up + cosine LR schedule, fault constants."""

from __future__ import annotations

import math
from typing import Any

import torch

PRECISIONS = ("fp32", "fp16", "bf16")
FAULTS = ("clean", "lr50", "nan_weight", "grad_explosion")
STEPS = 90         # optimizer steps of a run
FAULT_AT = 60      # trainer step at which the fault starts
RESUME_AT = 50     # trainer step of the checkpoint a resumed run restarts from
BATCH = 16
PRESET = "small"
DIM, HIDDEN, CLASSES = 16, 64, 4


def teacher_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and their teacher labels (the teacher is the same for every seed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, DIM, generator=g)
    return x, (x @ teacher).argmax(1)


def make_net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def lr_lambda(fault: str) -> Any:
    """Warm-up + cosine; ``lr50`` multiplies it by 50 from FAULT_AT on (a schedule bug)."""
    warm = 10

    def f(s: int) -> float:
        base = min(1.0, (s + 1) / warm) * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
        return base * (50.0 if fault == "lr50" and s >= FAULT_AT else 1.0)

    return f


def explode_hooks(net: torch.nn.Module, active: Any) -> None:
    """Gradients x1e4 while ``active()`` is true (a gradient explosion)."""
    for p in net.parameters():
        p.register_hook(lambda g: g * 1e4 if active() else g)


def poison(net: torch.nn.Sequential) -> None:
    """One weight of the first layer set to NaN."""
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")


@torch.no_grad()
def held_out_loss(net: torch.nn.Sequential, seed: int) -> float:
    """Cross-entropy on 512 held-out examples (``nan`` when not finite)."""
    x, y = teacher_data(512, seed + 99)
    was = net.training
    net.eval()
    v = float(torch.nn.functional.cross_entropy(net(x).float(), y))
    net.train(was)
    return v if math.isfinite(v) else math.nan
