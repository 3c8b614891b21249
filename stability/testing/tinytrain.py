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

    def lam(s: int) -> float:
        return sched_fn(s) * inj.lr_factor(s, clock["lr_it"])

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    res = RunResult(model, seed, steps, fault)
    guard: TorchGuard | None = None
    if monitor is not None or recorder is not None:
        kw = dict(checkpoint_every=checkpoint_every, clip_norm=clip_norm, scaler=scaler)
        kw.update(guard_kwargs or {})
        guard = TorchGuard(net, opt, sched, monitor, recorder=recorder, **kw)
    cap = max_iterations or 3 * steps
    step_lr = [math.nan]

    def seen_lr(optimizer: Any, args: Any, kwargs: Any) -> None:
        step_lr[0] = float(optimizer.param_groups[0]["lr"])  # after the guard's LR factor

    lr_hook = opt.register_step_pre_hook(seen_lr)
    positions = guard.batches(steps, cap) if guard is not None else iter(range(steps))
    t_steps = 0.0
    n_timed = 0
    bad_run = 0
    t0 = time.perf_counter()
    try:
        for pos in positions:
            it = clock["it"]
            inj.before_forward(it)
            x, y = (t.to(dev) for t in inj.batch(pos))
            ts = time.perf_counter()
            with autocast():
                loss = task.loss_fn(net, x, y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            inj.after_backward(it)
            step_lr[0] = math.nan
            clock["lr_it"] = it + 1
            if guard is not None:
                guard.step(loss)
            else:
                if scaler is not None:
                    scaler.unscale_(opt)
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            t_steps += time.perf_counter() - ts
            n_timed += 1
            lv = float(loss.detach())
            res.losses.append(lv)
            res.lrs.append(step_lr[0])
            if on_step is not None:
                on_step(it, lv)
            clock["it"] = it + 1
            done = pos + 1
            if eval_every and done % eval_every == 0:
                v = evaluate(net, task)
                res.val_losses[done] = v
                if guard is not None:
                    guard.validation(v)
            bad_run = bad_run + 1 if not math.isfinite(lv) else 0
            if guard is None and bad_run >= 20:
                break  # an unguarded run that has been NaN for 20 steps stays NaN
            if guard is not None and clock["it"] >= cap:
                break
    except TrainingStopped as e:
        res.stopped = e.reason
    finally:
        lr_hook.remove()
        inj.remove()
    res.wall_time_s = time.perf_counter() - t0
    res.step_time_s = t_steps / max(1, n_timed)
    res.iterations = clock["it"]
    res.final_loss = evaluate(net, task) if bad_run < 20 else math.nan
    if guard is not None:
        res.rollbacks = guard.rollbacks
        res.steps_lost = guard.steps_lost
        res.steps_skipped = guard.steps_skipped
        res.batches_skipped = guard.batches_skipped
        res.interventions = list(guard.interventions)
        guard.detach()
    return res
