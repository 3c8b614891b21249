"""Tiny models really trained on CPU, with real faults injected -- no downloads.

Two models:

* ``"gpt"`` -- a 2-layer character-level GPT trained on Python standard-library source text,
  read from the local files of stdlib modules (``inspect.getsourcefile``);
* ``"mlp"`` -- a 3-layer MLP classifying synthetic data labelled by a random teacher network.

Faults (:class:`~.faults.FaultSpec`, kinds in :data:`~.faults.FAULT_KINDS`; the table of kinds
is in :mod:`.faults`) are injected the way they happen, each tied to one of three clocks, which
decides whether it comes back after a rollback: the *iteration* (every optimizer iteration, never
rewound), the *scheduler step* (rewound by a rollback: the fault recurs when training reaches it
again) or the *data position* (rewound too: the same batches come again unless skipped).

The tasks and models live in :mod:`.tasks`, the faults in :mod:`.faults`; this module holds the
training loop (:func:`train_run`) and re-exports both.

Entry point::

    res = train_run("gpt", steps=300, seed=0, fault=FaultSpec("bit_flip", step=150),
                    monitor=Monitor("small"))
    res.final_loss, res.nonfinite, res.rollbacks, res.lrs[-1]

Data positions are addressable (batch ``i`` is a pure function of ``(seed, i)``), so a rollback
rewinds the data and the batches the monitor asks to skip are really skipped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from stability.adapters.interventions import TrainingStopped
from stability.adapters.torch import TorchGuard
from stability.testing.faults import _FAULT_DEFAULTS as _FAULT_DEFAULTS
from stability.testing.faults import (
    FAULT_CLOCK,
    FAULT_KINDS,
    FaultInjector,
    FaultSpec,
    flip_bit,
    spike_module,
)
from stability.testing.models import make_optimizer, make_schedule, make_task, precision_context
from stability.testing.tasks import MLP, Task, TinyGPT, prose_text, stdlib_text
from stability.testing.tasks import _gpt_task as _gpt_task
from stability.testing.tasks import _mlp_task as _mlp_task
from stability.testing.tasks import warmup_cosine as warmup_cosine

__all__ = [
    "FAULT_CLOCK",
    "FAULT_KINDS",
    "FaultInjector",
    "FaultSpec",
    "MLP",
    "RunResult",
    "TinyGPT",
    "flip_bit",
    "make_task",
    "prose_text",
    "spike_module",
    "stdlib_text",
    "train_run",
]


# ---------------------------------------------------------------------------- training
@dataclass
class RunResult:
    """What one run did.

    ``losses`` and ``lrs`` have one entry per iteration: the training loss and the effective LR of
    that iteration's optimizer step (NaN when the step was skipped).
    """

    model: str
    seed: int
    steps: int
    fault: FaultSpec | None
    losses: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    final_loss: float = math.nan
    iterations: int = 0
    rollbacks: int = 0
    steps_lost: int = 0
    steps_skipped: int = 0
    batches_skipped: int = 0
    interventions: list[Any] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    alarms: int = 0
    stopped: str | None = None
    step_time_s: float = math.nan
    wall_time_s: float = 0.0

    @property
    def nonfinite(self) -> bool:
        """Final held-out loss is NaN or infinite."""
        return not math.isfinite(self.final_loss)

    def acting_interventions(self) -> list[Any]:
        """Interventions other than alerts."""
        return [i for i in self.interventions if getattr(i, "type", "") != "alert"]


@torch.no_grad()
def evaluate(model: nn.Module, task: Task) -> float:
    """Mean loss over the task's fixed held-out batches."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    vals = [float(task.loss_fn(model, x.to(dev), y.to(dev))) for x, y in task.val_batches]
    model.train(was)
    return float(np.mean(vals))


def train_run(
    model: str = "gpt",
    steps: int = 300,
    seed: int = 0,
    fault: FaultSpec | None = None,
    monitor: Any = None,
    recorder: Any = None,
    *,
    clip_norm: float | None = None,
    eval_every: int = 25,
    checkpoint_every: int = 25,
    lr: float | None = None,
    batch_size: int | None = None,
    guard_kwargs: Mapping[str, Any] | None = None,
    max_iterations: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
    optimizer: str = "adamw",
    precision: str = "fp32",
    schedule: str = "warmup_cosine",
    device: str = "cpu",
) -> RunResult:
    """Train a tiny model for ``steps`` data positions, optionally with a fault and a monitor.

    Parameters
    ----------
    model : {"gpt", "mlp"}
    steps : int
        Batches to consume (a rollback costs extra iterations, not data).
    seed : int
        Seeds the model, the data order and the fault's randomness.
    fault : FaultSpec, optional
    monitor : Monitor, optional
        Attach through :class:`~stability.adapters.torch.TorchGuard`; it acts on its decisions.
    recorder : object with ``log(step, metrics)``, optional
        Records every step's signals (``loss``, ``lr``, ``grad_norm``, per-layer families,
        ``val_loss`` every ``eval_every`` steps). A guard is attached even without a monitor.
    clip_norm : float, optional
        Fixed clipping (the baseline); with a monitor, the loop's own clip.
    eval_every : int
        Validation period (its loss is fed to the monitor).
    checkpoint_every : int
        Guard checkpoint period (in memory).
    guard_kwargs : mapping, optional
        More :class:`~stability.adapters.torch.TorchGuard` arguments.
    max_iterations : int, optional
        Hard cap on iterations (default ``3 * steps``).
    on_step : callable, optional
        ``on_step(iteration, loss)`` after each iteration.
    optimizer, precision, schedule : str
        See :data:`.models.OPTIMIZERS`, :data:`.models.PRECISIONS` and
        :data:`.models.SCHEDULES` (defaults: AdamW, fp32, warm-up + cosine).
    device : str
        Where the model trains (``"cpu"``, ``"cuda"``, ``"cuda:1"``); batches are made on the
        CPU and moved there, so a run's data is the same on every device.

    Returns
    -------
    RunResult
    """
    task = make_task(model, seed, batch_size)
    dev = torch.device(device)
    net = task.make_model().to(dev)
    net.train()
    opt = make_optimizer(optimizer, net.parameters(), lr, task.lr)
    clock = {"it": 0, "lr_it": 0}  # lr_it: the iteration the scheduler computes the LR for
    sched_fn = make_schedule(schedule, steps)
    autocast, scaler = precision_context(precision, dev.type)
    inj = FaultInjector(fault, task, net)
    sched = _faulty_schedule(opt, sched_fn, inj, clock)
    res = RunResult(model, seed, steps, fault)
    guard: TorchGuard | None = None
    if monitor is not None or recorder is not None:
        kw = dict(checkpoint_every=checkpoint_every, clip_norm=clip_norm, scaler=scaler)
        kw.update(guard_kwargs or {})
        guard = TorchGuard(net, opt, sched, monitor, recorder=recorder, **kw)
    loop = _Loop(task, dev, net, opt, sched, autocast, scaler, inj, clock, guard, res,
                 clip_norm, eval_every, max_iterations or 3 * steps, on_step)
    return loop.run(steps)


def _faulty_schedule(opt: torch.optim.Optimizer, sched_fn: Callable[[int], float],
                     inj: FaultInjector, clock: dict[str, int]) -> LambdaLR:
    """The schedule's LR multiplier times the fault's (an LR fault is tied to the scheduler
    step or to the iteration the LR is computed for, ``clock["lr_it"]``)."""

    def lam(s: int) -> float:
        return sched_fn(s) * inj.lr_factor(s, clock["lr_it"])

    return LambdaLR(opt, lam)


@dataclass
class _Loop:
    """One run's training loop: what it trains and steps, and what it measured so far."""

    task: Task
    dev: torch.device
    net: nn.Module
    opt: torch.optim.Optimizer
    sched: LambdaLR
    autocast: Callable[[], Any]
    scaler: Any
    inj: FaultInjector
    #: ``it``: iterations done; ``lr_it``: the iteration the scheduler computes the LR for
    clock: dict[str, int]
    guard: TorchGuard | None
    res: RunResult
    clip_norm: float | None
    eval_every: int
    #: hard cap on iterations of a guarded run
    cap: int
    on_step: Callable[[int, float], None] | None
    #: the LR of this iteration's optimizer step (NaN: no optimizer step)
    step_lr: float = math.nan
    t_steps: float = 0.0
    n_timed: int = 0
    #: consecutive iterations with a non-finite loss
    bad_run: int = 0

    def seen_lr(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer pre-step hook: the LR really used (after the guard's LR factor)."""
        self.step_lr = float(optimizer.param_groups[0]["lr"])

    def run(self, steps: int) -> RunResult:
        """Train over ``steps`` data positions (the guard's, honouring rollbacks and skips)."""
        lr_hook = self.opt.register_step_pre_hook(self.seen_lr)
        g = self.guard
        positions = g.batches(steps, self.cap) if g is not None else iter(range(steps))
        t0 = time.perf_counter()
        try:
            for pos in positions:
                if self.iteration(pos):
                    break
        except TrainingStopped as e:
            self.res.stopped = e.reason
        finally:
            lr_hook.remove()
            self.inj.remove()
        self.res.wall_time_s = time.perf_counter() - t0
        return self.finish()

    def iteration(self, pos: int) -> bool:
        """One iteration on the batch at data position ``pos``; ``True``: the run ends."""
        it = self.clock["it"]
        self.inj.before_forward(it)
        x, y = (t.to(self.dev) for t in self.inj.batch(pos))
        ts = time.perf_counter()
        loss = self.backward(x, y, it)
        self.step_lr = math.nan
        self.clock["lr_it"] = it + 1
        if self.guard is not None:
            self.guard.step(loss)
        else:
            self.plain_step()
        self.t_steps += time.perf_counter() - ts
        self.n_timed += 1
        lv = self.record(it, loss)
        self.clock["it"] = it + 1
        self.validate(pos + 1)
        return self.should_end(lv)

    def backward(self, x: torch.Tensor, y: torch.Tensor, it: int) -> torch.Tensor:
        """Forward and backward (scaled under fp16), then the fault's after-backward hook."""
        with self.autocast():
            loss = self.task.loss_fn(self.net, x, y)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        self.inj.after_backward(it)
        return loss

    def plain_step(self) -> None:
        """The unguarded baseline's optimizer step: unscale, fixed clip, step, schedule."""
        opt, scaler = self.opt, self.scaler
        if scaler is not None:
            scaler.unscale_(opt)
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip_norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        self.sched.step()
        opt.zero_grad(set_to_none=True)

    def record(self, it: int, loss: torch.Tensor) -> float:
        """Record the iteration's loss and LR (and tell ``on_step``); returns the loss."""
        lv = float(loss.detach())
        self.res.losses.append(lv)
        self.res.lrs.append(self.step_lr)
        if self.on_step is not None:
            self.on_step(it, lv)
        return lv

    def validate(self, done: int) -> None:
        """Every ``eval_every`` data positions: the held-out loss, fed to the guard."""
        if not (self.eval_every and done % self.eval_every == 0):
            return
        v = evaluate(self.net, self.task)
        self.res.val_losses[done] = v
        if self.guard is not None:
            self.guard.validation(v)

    def should_end(self, lv: float) -> bool:
        """An unguarded run NaN for 20 iterations stays NaN; a guarded one stops at the cap."""
        self.bad_run = self.bad_run + 1 if not math.isfinite(lv) else 0
        if self.guard is None:
            return self.bad_run >= 20
        return self.clock["it"] >= self.cap

    def finish(self) -> RunResult:
        """Fill the result: timings, iterations, the final held-out loss, the guard's counts."""
        res = self.res
        res.step_time_s = self.t_steps / max(1, self.n_timed)
        res.iterations = self.clock["it"]
        res.final_loss = evaluate(self.net, self.task) if self.bad_run < 20 else math.nan
        guard = self.guard
        if guard is not None:
            res.rollbacks = guard.rollbacks
            res.steps_lost = guard.steps_lost
            res.steps_skipped = guard.steps_skipped
            res.batches_skipped = guard.batches_skipped
            res.interventions = list(guard.interventions)
            guard.detach()
        return res
