"""Faults injected into the tiny training runs of :mod:`.tinytrain`, each the way it happens.

:class:`FaultSpec` names one (kinds in :data:`FAULT_KINDS`, default strengths per kind);
:class:`FaultInjector` carries it out inside the training loop.

Each fault is tied to one of three clocks, which decides whether it comes back after a rollback:
the *iteration* (every optimizer iteration, never rewound: a rollback does not bring the fault
back), the *scheduler step* (rewound by a rollback: the fault recurs when training reaches it
again) or the *data position* (rewound too: the same batches come again unless skipped).
``duration 0`` means "from ``step`` to the end of the run".

====================  =========================================================================
``lr_blowup``         the LR is multiplied by ``magnitude`` for ``duration`` iterations (a
                      transient bad value from outside; it does not recur after a rollback)
``lr_persistent``     a bad config: from iteration ``step`` to the end the LR is ``magnitude``
                      times the schedule (default x30; it is still there after any rollback)
``lr_ramp``           a re-warmup to a too-high peak: from scheduler step ``step`` the LR
                      multiplier rises linearly over ``duration`` scheduler steps to
                      ``magnitude`` (default x20) and stays there (recurs after a rollback)
``schedule_bug``      the LR schedule itself jumps by ``magnitude`` for ``duration`` scheduler
                      steps, ``0`` = for good (it recurs if the scheduler is rolled back)
``data_corruption``   the batches at data positions ``[step, step + duration)`` are garbage
                      (GPT: random bytes with shuffled targets; MLP: inputs scaled by
                      ``magnitude`` with random labels); ``duration 0`` = every batch from then on
``input_shift``       from data position ``step`` to the end the inputs shift (the held-out set
                      does not): MLP: inputs scaled by ``magnitude`` (8 = up, 0.125 = down); GPT
                      (no input scale): ``magnitude > 1`` the text is case-swapped (same code,
                      other token ids), ``magnitude < 1`` it switches domain from Python code to
                      English prose (the stdlib's ``pydoc_data.topics`` help text)
``bit_flip``          one exponent bit (``magnitude`` = bit index) of one weight flips at
                      iteration ``step``
``weight_scale``      one weight matrix (the first hidden one) is multiplied by ``magnitude``
                      (default 1e3) at iteration ``step``, once
``activation_spike``  a forward hook multiplies one hidden block's output (MLP: the second
                      linear layer; GPT: the first block's feed-forward output, before the
                      residual add) by ``magnitude`` for ``duration`` iterations (training only)
``grad_explosion``    gradients are multiplied by ``magnitude`` for ``duration`` iterations
``fp16_overflow``     an fp16 overflow storm without a loss scaler: every gradient is
                      multiplied by ``magnitude`` (default ``inf``, so entries become +-inf, and
                      NaN where the gradient was 0) for ``duration`` iterations
``fp16_underflow``    gradients multiplied by ``magnitude`` (default 1e-8) for ``duration``
                      iterations: the updates vanish
``overfit``           from data position ``step`` on, batches come from a tiny pool (val rises)
====================  =========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from stability.testing.tasks import Task, TinyGPT

__all__ = ["FAULT_CLOCK", "FAULT_KINDS", "FaultInjector", "FaultSpec", "flip_bit", "spike_module"]

FAULT_KINDS = ("lr_blowup", "schedule_bug", "data_corruption", "bit_flip", "grad_explosion",
               "overfit", "lr_persistent", "lr_ramp", "input_shift", "weight_scale",
               "activation_spike", "fp16_overflow", "fp16_underflow")

#: default magnitude / duration per fault kind (duration 0 = to the end of the run)
_FAULT_DEFAULTS: dict[str, tuple[float, int]] = {
    "lr_blowup": (100.0, 10),
    "schedule_bug": (30.0, 40),
    "data_corruption": (1e3, 8),
    "bit_flip": (30.0, 1),  # magnitude = bit index (30: exponent MSB of float32)
    "grad_explosion": (1e4, 3),
    "overfit": (4.0, 0),  # magnitude = pool size in batches
    "lr_persistent": (30.0, 0),
    "lr_ramp": (20.0, 50),  # duration = length of the ramp; the peak then holds to the end
    "input_shift": (8.0, 0),
    "weight_scale": (1e3, 1),
    "activation_spike": (100.0, 5),
    "fp16_overflow": (math.inf, 5),
    "fp16_underflow": (1e-8, 100),
}

#: which clock each kind is tied to (see the module docstring)
FAULT_CLOCK: dict[str, str] = {
    "lr_blowup": "iteration", "lr_persistent": "iteration", "bit_flip": "iteration",
    "weight_scale": "iteration", "activation_spike": "iteration",
    "grad_explosion": "iteration", "fp16_overflow": "iteration", "fp16_underflow": "iteration",
    "schedule_bug": "scheduler", "lr_ramp": "scheduler",
    "data_corruption": "data", "input_shift": "data", "overfit": "data",
}


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject.

    Parameters
    ----------
    kind : str
        One of :data:`FAULT_KINDS`.
    step : int
        Onset (iteration, scheduler step or data position, see the module docstring).
    duration : int, optional
        Length in steps (default per kind).
    magnitude : float, optional
        Strength (default per kind).

    Examples
    --------
    >>> FaultSpec("lr_blowup", 100)
    FaultSpec(kind='lr_blowup', step=100, duration=10, magnitude=100.0)
    """

    kind: str
    step: int
    duration: int = -1
    magnitude: float = math.nan

    def __post_init__(self) -> None:
        if self.kind not in _FAULT_DEFAULTS:
            raise ValueError(f"The 'kind' parameter of FaultSpec must be one of {FAULT_KINDS}. "
                             f"Got {self.kind!r} instead.")
        mag, dur = _FAULT_DEFAULTS[self.kind]
        if self.duration < 0:
            object.__setattr__(self, "duration", dur)
        if math.isnan(self.magnitude):
            object.__setattr__(self, "magnitude", mag)

    def active(self, t: int) -> bool:
        """Whether ``t`` lies in ``[step, step + duration)`` (``duration 0`` = open-ended)."""
        return t >= self.step and (self.duration == 0 or t < self.step + self.duration)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "duration": self.duration,
                "magnitude": self.magnitude}



def flip_bit(t: torch.Tensor, flat_index: int, bit: int = 30) -> float:
    """Flip one bit of one float32 element in place; returns the new value.

    Examples
    --------
    >>> t = torch.tensor([0.5]); flip_bit(t, 0, 30)
    1.7014118346046923e+38
    """
    with torch.no_grad():
        v = t.view(-1)[flat_index : flat_index + 1]
        as_int = v.view(torch.int32)
        as_int ^= torch.tensor(1 << bit, dtype=torch.int32) if bit < 31 else torch.tensor(
            -(1 << 31), dtype=torch.int32)
        return float(v.item())



class FaultInjector:
    """Carries out one :class:`FaultSpec` inside a training loop.

    The loop calls :meth:`lr_factor` from its LR schedule, :meth:`batch` for the batch at a data
    position, :meth:`before_forward` at the start of an iteration and :meth:`after_backward`
    between ``backward()`` and the optimizer step. Everything is a pure function of the task's
    seed, the fault and the clocks, so runs are deterministic per ``(seed, fault)``.

    Parameters
    ----------
    fault : FaultSpec or None
        ``None`` injects nothing.
    task : Task
        Supplies the batches (and the corrupt / shifted variants).
    net : torch.nn.Module
        The model of ``task`` (weight faults and the activation hook act on it).

    Examples
    --------
    >>> from stability.testing.models import make_task
    >>> task = make_task("mlp", seed=0)
    >>> inj = FaultInjector(FaultSpec("input_shift", 10, magnitude=8.0), task, task.make_model())
    >>> float(inj.batch(10)[0].std() / task.batch(10)[0].std())
    8.0
    >>> inj.lr_factor(sched_step=50, iteration=50)
    1.0
    """

    def __init__(self, fault: FaultSpec | None, task: Task, net: nn.Module) -> None:
        self.fault = fault
        self.kind = fault.kind if fault is not None else ""
        self.task = task
        self.net = net
        self.iteration = 0
        self._hook: Any = None
        self.target = _flip_target(net, task.seed)
        if self.kind == "activation_spike":
            self._hook = spike_module(net).register_forward_hook(self._spike)

    def lr_factor(self, sched_step: int, iteration: int) -> float:
        """Factor on the scheduled LR for scheduler step ``sched_step`` used at ``iteration``."""
        f = self.fault
        if f is None:
            return 1.0
        if f.kind == "schedule_bug" and f.active(sched_step):
            return f.magnitude
        if f.kind in ("lr_blowup", "lr_persistent") and f.active(iteration):
            return f.magnitude
        if f.kind == "lr_ramp" and sched_step >= f.step:
            done = 1.0 if f.duration == 0 else min(1.0, (sched_step - f.step + 1) / f.duration)
            return 1.0 + (f.magnitude - 1.0) * done
        return 1.0

    def batch(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (possibly faulty) batch at data position ``pos``."""
        f = self.fault
        if f is not None and f.kind == "overfit" and f.active(pos):
            pos = f.step + (pos % max(1, int(f.magnitude)))
        b = self.task.batch(pos)
        if f is not None and f.active(pos):
            if f.kind == "data_corruption":
                b = self.task.corrupt(pos, b, f.magnitude)
            elif f.kind == "input_shift":
                b = self.task.shift(pos, b, f.magnitude)
        return b

    def before_forward(self, iteration: int) -> None:
        """Start of ``iteration``: one-off weight faults; arms the activation hook."""
        self.iteration = iteration
        f = self.fault
        if f is None or iteration != f.step:
            return
        p, k = self.target
        if f.kind == "bit_flip":
            flip_bit(p.data, k, int(f.magnitude))
        elif f.kind == "weight_scale":
            with torch.no_grad():
                p.mul_(f.magnitude)

    def after_backward(self, iteration: int) -> None:
        """Gradient faults of ``iteration`` (explosion, fp16 overflow / underflow)."""
        f = self.fault
        if f is None or f.kind not in ("grad_explosion", "fp16_overflow", "fp16_underflow"):
            return
        if not f.active(iteration):
            return
        with torch.no_grad():
            for p in self.net.parameters():
                if p.grad is not None:
                    p.grad.mul_(f.magnitude)  # inf * 0 = NaN, as in a real overflow storm

    def _spike(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        f = self.fault
        if f is not None and module.training and f.active(self.iteration):
            return out * f.magnitude
        return None

    def remove(self) -> None:
        """Remove the forward hook (if any)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def spike_module(net: nn.Module) -> nn.Module:
    """The hidden block whose output ``activation_spike`` scales.

    MLP: the second linear layer (hidden -> hidden); GPT: the first block's feed-forward output
    projection (before the residual add, so the final LayerNorm cannot simply undo it).
    """
    target = getattr(net, "spike_target", None)
    if callable(target):
        return target()
    if isinstance(net, TinyGPT):
        blk: Any = net.blocks[0]
        return blk.linear2
    mods = [m for m in net.modules() if isinstance(m, nn.Linear)]
    return mods[1] if len(mods) > 2 else mods[0]



def _flip_target(net: nn.Module, seed: int) -> tuple[torch.nn.Parameter, int]:
    """A weight that every forward uses: an element of the first hidden matrix."""
    mats = [p for n, p in net.named_parameters() if p.dim() == 2 and "embedding" not in n
            and not n.startswith(("tok", "pos"))]
    p = mats[0]
    k = int(np.random.default_rng(seed).integers(0, p.numel()))
    return p, k
