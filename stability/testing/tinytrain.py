"""Tiny models really trained on CPU, with real faults injected -- no downloads.

Two models:

* ``"gpt"`` -- a 2-layer character-level GPT trained on Python standard-library source text,
  read from the local files of stdlib modules (``inspect.getsourcefile``);
* ``"mlp"`` -- a 3-layer MLP classifying synthetic data labelled by a random teacher network.

Faults (:class:`FaultSpec`, kinds in :data:`FAULT_KINDS`), each injected the way it happens:

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

Entry point::

    res = train_run("gpt", steps=300, seed=0, fault=FaultSpec("bit_flip", step=150),
                    monitor=Monitor("small"))
    res.final_loss, res.nonfinite, res.rollbacks, res.lrs[-1]

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


def prose_text(max_chars: int = 600_000) -> str:
    """English prose: the help topics shipped with the standard library (``pydoc_data``).

    The other domain of the GPT's ``input_shift`` fault (the training text is Python code).

    Examples
    --------
    >>> t = prose_text(10_000)
    >>> len(t), "def " in t[:2000]
    (10000, False)
    """
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))[:max_chars]


def _ascii_ids(text: str) -> torch.Tensor:
    raw = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return torch.from_numpy(np.minimum(raw, 127).astype(np.int64))


#: token id -> id of the same character with its case swapped (the GPT's upward input shift)
_SWAPCASE = torch.tensor([ord(chr(c).swapcase()) if chr(c).isalpha() else c for c in range(128)])


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
    shift: Callable[[int, tuple[torch.Tensor, torch.Tensor], float],
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
        return self.head(self.ln(x))


class MLP(nn.Sequential):
    """``din -> h -> h -> classes`` with GELU."""

    def __init__(self, din: int = 32, h: int = 128, classes: int = 10) -> None:
        super().__init__(nn.Linear(din, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
                         nn.Linear(h, classes))


def _gpt_task(seed: int, batch_size: int, ctx: int = 64,
              model_factory: Callable[[], nn.Module] | None = None, name: str = "gpt") -> Task:
    """The character-LM task (``model_factory`` and ``ctx``: another model on the same text)."""
    data = _ascii_ids(stdlib_text())
    n_val = len(data) // 10
    train, val = data[:-n_val], data[-n_val:]

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

    prose: list[torch.Tensor] = []

    def shift(i: int, b: tuple[torch.Tensor, torch.Tensor], mag: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if mag >= 1.0:  # the same text, case-swapped
            return _SWAPCASE[b[0]], _SWAPCASE[b[1]]
        if not prose:  # another domain: English prose instead of code
            prose.append(_ascii_ids(prose_text()))
        return sample(prose[0], np.random.default_rng([seed, i]), b[0].shape[0])

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return TinyGPT() if model_factory is None else model_factory()

    return Task(name, seed, batch_size, make_model, batch, val_batches, loss_fn, 3e-3, corrupt,
                shift)


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

    def shift(i: int, b: tuple[torch.Tensor, torch.Tensor], mag: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return b[0] * mag, b[1]  # same labels: only the input scale moved

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return MLP(din, 128, classes)

    return Task("mlp", seed, batch_size, make_model, batch, val_batches, loss_fn, 3e-3, corrupt,
                shift)


def make_task(model: str, seed: int = 0, batch_size: int | None = None) -> Task:
    """The :class:`Task` for ``"gpt"``, ``"mlp"`` or a model of :data:`.models.TASKS`."""
    if model == "gpt":
        return _gpt_task(seed, batch_size or 16)
    if model == "mlp":
        return _mlp_task(seed, batch_size or 64)
    from .models import TASKS

    if model in TASKS:
        return TASKS[model](seed, batch_size)
    raise ValueError(f"The 'model' parameter of make_task must be one of "
                     f"{('gpt', 'mlp', *TASKS)}. Got {model!r} instead.")


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


# ---------------------------------------------------------------------------- faults
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
    optimizer: str = "adamw",
    precision: str = "fp32",
    schedule: str = "warmup_cosine",
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

    Returns
    -------
    RunResult
    """
    task = make_task(model, seed, batch_size)
    net = task.make_model()
    net.train()
    from .models import make_optimizer, make_schedule, precision_context

    opt = make_optimizer(optimizer, net.parameters(), lr, task.lr)
    clock = {"it": 0, "lr_it": 0}  # lr_it: the iteration the scheduler computes the LR for
    sched_fn = make_schedule(schedule, steps)
    autocast, scaler = precision_context(precision)
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
            x, y = inj.batch(pos)
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


def _flip_target(net: nn.Module, seed: int) -> tuple[torch.nn.Parameter, int]:
    """A weight that every forward uses: an element of the first hidden matrix."""
    mats = [p for n, p in net.named_parameters() if p.dim() == 2 and "embedding" not in n
            and not n.startswith(("tok", "pos"))]
    p = mats[0]
    k = int(np.random.default_rng(seed).integers(0, p.numel()))
    return p, k
