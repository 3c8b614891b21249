"""Tiny models really trained on CPU, with real faults injected -- no downloads.

Two models:

* ``"gpt"`` -- a 2-layer character-level GPT trained on Python standard-library source text,
  read from the local files of stdlib modules (``inspect.getsourcefile``);
* ``"mlp"`` -- a 3-layer MLP classifying synthetic data labelled by a random teacher network.

Faults (:class:`FaultSpec`, kinds in :data:`FAULT_KINDS`), each injected the way it happens:

==================  ===========================================================================
``lr_blowup``       the LR is multiplied by ``magnitude`` for ``duration`` iterations (a
                    transient bad value from outside; it does not recur after a rollback)
``schedule_bug``    the LR schedule itself jumps by ``magnitude`` for ``duration`` scheduler
                    steps (it recurs if the scheduler is rolled back before it)
``data_corruption`` the batches at data positions ``[step, step + duration)`` are garbage
                    (GPT: random bytes with shuffled targets; MLP: inputs scaled by
                    ``magnitude`` with random labels)
``bit_flip``        one exponent bit of one weight flips at iteration ``step``
``grad_explosion``  gradients are multiplied by ``magnitude`` for ``duration`` iterations
``overfit``         from data position ``step`` on, batches come from a tiny pool (val rises)
==================  ===========================================================================

Entry point::

    res = train_run("gpt", steps=300, seed=0, fault=FaultSpec("bit_flip", step=150),
                    monitor=Monitor("small"))
    res.final_loss, res.diverged, res.rollbacks

Data positions are addressable (batch ``i`` is a pure function of ``(seed, i)``), so a rollback
rewinds the data and the batches the monitor asks to skip are really skipped.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.interventions import TrainingStopped
from ..adapters.torch import TorchGuard

__all__ = [
    "FAULT_KINDS",
    "FaultSpec",
    "MLP",
    "RunResult",
    "TinyGPT",
    "flip_bit",
    "make_task",
    "stdlib_text",
    "train_run",
]

FAULT_KINDS = ("lr_blowup", "schedule_bug", "data_corruption", "bit_flip", "grad_explosion",
               "overfit")

#: default magnitude / duration per fault kind
_FAULT_DEFAULTS: dict[str, tuple[float, int]] = {
    "lr_blowup": (100.0, 10),
    "schedule_bug": (30.0, 40),
    "data_corruption": (1e3, 8),
    "bit_flip": (30.0, 1),  # magnitude = bit index (30: exponent MSB of float32)
    "grad_explosion": (1e4, 3),
    "overfit": (4.0, 0),  # magnitude = pool size in batches; duration 0 = to the end
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


# ---------------------------------------------------------------------------- data
_STDLIB = ("json.decoder", "json.encoder", "textwrap", "argparse", "string", "functools",
           "collections", "difflib", "shlex", "calendar", "fractions", "heapq", "bisect",
           "dataclasses", "pprint", "configparser", "inspect", "tokenize")


def stdlib_text(max_chars: int = 600_000) -> str:
    """Python source of a fixed list of standard-library modules, read from local files.

    Examples
    --------
    >>> t = stdlib_text(10_000)
    >>> len(t), "def " in t
    (10000, True)
    """
    import importlib

    parts: list[str] = []
    total = 0
    for name in _STDLIB:
        try:
            path = inspect.getsourcefile(importlib.import_module(name))
        except (ImportError, TypeError):
            continue
        if path is None:
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            parts.append(fh.read())
        total += len(parts[-1])
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


@dataclass
class Task:
    """Data and model factory of one tiny problem; ``batch(i)`` is a pure function of ``i``."""

    name: str
    seed: int
    batch_size: int
    make_model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    lr: float
    corrupt: Callable[[int, tuple[torch.Tensor, torch.Tensor], float],
                      tuple[torch.Tensor, torch.Tensor]]


class TinyGPT(nn.Module):
    """A minimal GPT: token + position embedding, pre-LN blocks, tied-free LM head."""

    def __init__(self, vocab: int = 128, ctx: int = 64, d: int = 64, n_layer: int = 2,
                 n_head: int = 4) -> None:
        super().__init__()
        self.ctx = ctx
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout=0.0, batch_first=True,
                                       norm_first=True, activation="gelu")
            for _ in range(n_layer))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        for blk in self.blocks:
            x = blk(x, src_mask=mask[:t, :t], is_causal=True)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


class MLP(nn.Sequential):
    """``din -> h -> h -> classes`` with GELU."""

    def __init__(self, din: int = 32, h: int = 128, classes: int = 10) -> None:
        super().__init__(nn.Linear(din, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
                         nn.Linear(h, classes))


def _gpt_task(seed: int, batch_size: int) -> Task:
    raw = np.frombuffer(stdlib_text().encode("ascii", errors="replace"), dtype=np.uint8)
    data = torch.from_numpy(np.minimum(raw, 127).astype(np.int64))
    n_val = len(data) // 10
    train, val = data[:-n_val], data[-n_val:]
    ctx = 64

    def sample(src: torch.Tensor, rng: np.random.Generator, n: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        off = rng.integers(0, len(src) - ctx - 1, size=n)
        idx = torch.from_numpy(off)[:, None] + torch.arange(ctx + 1)[None, :]
        chunk = src[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(train, np.random.default_rng([seed, i]), batch_size)

    vrng = np.random.default_rng([seed, 10**9])
    val_batches = [sample(val, vrng, 32) for _ in range(4)]

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x).reshape(-1, 128), y.reshape(-1))

    def corrupt(i: int, b: tuple[torch.Tensor, torch.Tensor], mag: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 7919 + i)
        x = torch.randint(0, 128, b[0].shape, generator=g)
        y = torch.full_like(b[1], int(torch.randint(0, 128, (1,), generator=g)))
        return x, y  # garbage input, one constant target: a degenerate shard

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return TinyGPT()

    return Task("gpt", seed, batch_size, make_model, batch, val_batches, loss_fn, 3e-3, corrupt)


def _mlp_task(seed: int, batch_size: int) -> Task:
    din, classes = 32, 10
    g = torch.Generator().manual_seed(10_000 + seed)
    teacher = [torch.randn(din, 64, generator=g), torch.randn(64, classes, generator=g)]
    n_train = 8192
    xs = torch.randn(n_train + 2048, din, generator=g)
    ys = (torch.tanh(xs @ teacher[0]) @ teacher[1]).argmax(1)
    flip = torch.rand(len(ys), generator=g) < 0.05
    ys = torch.where(flip, torch.randint(0, classes, ys.shape, generator=g), ys)
    xtr, ytr, xva, yva = xs[:n_train], ys[:n_train], xs[n_train:], ys[n_train:]

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(np.random.default_rng([seed, i]).integers(0, n_train, batch_size))
        return xtr[idx], ytr[idx]

    val_batches = [(xva[k:k + 512], yva[k:k + 512]) for k in range(0, 2048, 512)]

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    def corrupt(i: int, b: tuple[torch.Tensor, torch.Tensor], mag: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        gg = torch.Generator().manual_seed(seed * 7919 + i)
        return b[0] * mag, torch.randint(0, classes, b[1].shape, generator=gg)

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return MLP(din, 128, classes)

    return Task("mlp", seed, batch_size, make_model, batch, val_batches, loss_fn, 3e-3, corrupt)


def make_task(model: str, seed: int = 0, batch_size: int | None = None) -> Task:
    """The :class:`Task` for ``"gpt"`` or ``"mlp"``."""
    if model == "gpt":
        return _gpt_task(seed, batch_size or 16)
    if model == "mlp":
        return _mlp_task(seed, batch_size or 64)
    raise ValueError(f"The 'model' parameter of make_task must be 'gpt' or 'mlp'. Got {model!r}.")


def warmup_cosine(total: int, warmup: int, floor: float = 0.1) -> Callable[[int], float]:
    """LR multiplier: linear warm-up then cosine decay to ``floor``.

    Examples
    --------
    >>> f = warmup_cosine(100, 10)
    >>> f(0), f(10), round(f(99), 3)
    (0.1, 1.0, 0.1)
    """
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return f


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


# ---------------------------------------------------------------------------- training
@dataclass
class RunResult:
    """What one run did."""

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
    vals = [float(task.loss_fn(model, x, y)) for x, y in task.val_batches]
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

    Returns
    -------
    RunResult
    """
    task = make_task(model, seed, batch_size)
    net = task.make_model()
    net.train()
    base_lr = lr or task.lr
    opt = torch.optim.AdamW(net.parameters(), lr=base_lr, weight_decay=0.01)
    clock = {"it": 0}
    sched_fn = warmup_cosine(steps, max(1, steps // 10))

    def lam(s: int) -> float:
        f = sched_fn(s)
        if fault is not None and fault.kind == "schedule_bug" and fault.active(s):
            f *= fault.magnitude
        if fault is not None and fault.kind == "lr_blowup" and fault.active(clock["it"] + 1):
            f *= fault.magnitude
        return f

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    if fault is not None and fault.kind == "lr_blowup" and fault.active(0):
        opt.param_groups[0]["lr"] *= fault.magnitude
    res = RunResult(model, seed, steps, fault)
    guard: TorchGuard | None = None
    if monitor is not None or recorder is not None:
        kw = dict(checkpoint_every=checkpoint_every, clip_norm=clip_norm)
        kw.update(guard_kwargs or {})
        guard = TorchGuard(net, opt, sched, monitor, recorder=recorder, **kw)  # type: ignore[arg-type]
    pool = max(1, int(fault.magnitude)) if fault is not None and fault.kind == "overfit" else 0
    cap = max_iterations or 3 * steps
    flip_target = _flip_target(net, seed)

    def get_batch(pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if fault is not None and fault.kind == "overfit" and fault.active(pos):
            pos = fault.step + (pos % pool)
        b = task.batch(pos)
        if fault is not None and fault.kind == "data_corruption" and fault.active(pos):
            b = task.corrupt(pos, b, fault.magnitude)
        return b

    positions = guard.batches(steps, cap) if guard is not None else iter(range(steps))
    t_steps = 0.0
    n_timed = 0
    bad_run = 0
    t0 = time.perf_counter()
    try:
        for pos in positions:
            it = clock["it"]
            if fault is not None and fault.kind == "bit_flip" and it == fault.step:
                p, k = flip_target
                flip_bit(p.data, k, int(fault.magnitude))
            x, y = get_batch(pos)
            ts = time.perf_counter()
            loss = task.loss_fn(net, x, y)
            loss.backward()
            if fault is not None and fault.kind == "grad_explosion" and fault.active(it):
                with torch.no_grad():
                    for p in net.parameters():
                        if p.grad is not None:
                            p.grad.mul_(fault.magnitude)
            if guard is not None:
                guard.step(loss)
            else:
                if clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            t_steps += time.perf_counter() - ts
            n_timed += 1
            lv = float(loss.detach())
            res.losses.append(lv)
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


def _flip_target(net: nn.Module, seed: int) -> tuple[torch.nn.Parameter, int]:
    """A weight that every forward uses: an element of the first hidden matrix."""
    mats = [p for n, p in net.named_parameters() if p.dim() == 2 and "embedding" not in n
            and not n.startswith(("tok", "pos"))]
    p = mats[0]
    k = int(np.random.default_rng(seed).integers(0, p.numel()))
    return p, k
