"""More tiny architectures, optimizers, precisions and LR schedules for :mod:`.tinytrain`.

Registered in ``TASKS`` (built by name with :func:`make_task`) and selected by
:func:`.tinytrain.train_run`'s ``optimizer`` / ``precision`` / ``schedule`` arguments; used by the
detection benchmark (``benchmarks/make_benchmark.py``).

Architectures (all on the character-level Python-source task of ``"gpt"``, small enough to train
a few hundred steps in seconds on one CPU core):

==============  ==============================================================================
``gpt_pre``     :class:`~.tinytrain.TinyGPT` (pre-LN), width 32, context 32
``gpt_post``    :class:`PostLNGPT`: the same with post-LN blocks (LayerNorm after the residual)
``conv``        :class:`CausalConvLM`: a causal 1-D convolutional char LM with residual blocks
==============  ==============================================================================

Optimizers (:data:`OPTIMIZERS`): ``adamw``, ``sgd`` (momentum 0.9, Nesterov), ``rmsprop``,
``adagrad``; each scales the task's AdamW learning rate by its own factor.
Precisions (:data:`PRECISIONS`): ``fp32``; ``bf16`` (CPU autocast); ``fp16`` (CPU autocast in
float16 and a ``torch.amp.GradScaler("cpu")``: overflow steps are skipped by the scaler).
Schedules (:data:`SCHEDULES`): ``warmup_cosine``, ``constant``, ``step`` (x0.3 at 50% and 80%),
``linear`` (warm-up then linear decay to 10%), all with a 10% linear warm-up except ``constant``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stability.testing.tasks import Task, TinyGPT, _gpt_task, _mlp_task, warmup_cosine

__all__ = ["CausalConvLM", "OPTIMIZERS", "PRECISIONS", "PostLNGPT", "SCHEDULES", "TASKS",
           "make_optimizer", "make_schedule", "make_task", "precision_context"]

#: context length and width of the benchmark's small char models
CTX = 32
WIDTH = 32


class PostLNGPT(TinyGPT):
    """:class:`~.tinytrain.TinyGPT` with post-LN blocks (the original Transformer's layout)."""

    def __init__(self, vocab: int = 128, ctx: int = CTX, d: int = WIDTH, n_layer: int = 2,
                 n_head: int = 4) -> None:
        super().__init__(vocab, ctx, d, n_layer, n_head)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout=0.0, batch_first=True,
                                       norm_first=False, activation="gelu")
            for _ in range(n_layer))


class _ConvBlock(nn.Module):
    def __init__(self, d: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.conv = nn.Conv1d(d, 2 * d, kernel, dilation=dilation)
        self.proj = nn.Conv1d(2 * d, d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, d, time)
        h = self.proj(F.gelu(self.conv(F.pad(x, (self.pad, 0)))))
        return x + h


class CausalConvLM(nn.Module):
    """Embedding, dilated causal 1-D convolution blocks with residuals, LayerNorm, linear head."""

    def __init__(self, vocab: int = 128, d: int = WIDTH, kernel: int = 3,
                 dilations: tuple[int, ...] = (1, 2, 4)) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_ConvBlock(d, kernel, dl) for dl in dilations)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def spike_target(self) -> nn.Module:
        """The module ``activation_spike`` scales: the first block's output projection."""
        blk: Any = self.blocks[0]
        return blk.proj

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x.transpose(1, 2)))


def _char_task(name: str, factory: Callable[[], nn.Module]) -> Callable[[int, int | None], Task]:
    def make(seed: int, batch_size: int | None) -> Task:
        return _gpt_task(seed, batch_size or 16, ctx=CTX, model_factory=factory, name=name)
    return make


#: architecture name -> ``(seed, batch_size or None) -> Task``
TASKS: dict[str, Callable[[int, int | None], Task]] = {
    "gpt_pre": _char_task("gpt_pre", lambda: TinyGPT(ctx=CTX, d=WIDTH)),
    "gpt_post": _char_task("gpt_post", lambda: PostLNGPT()),
    "conv": _char_task("conv", lambda: CausalConvLM()),
}

#: optimizer name -> (factory(params, lr), factor on the task's AdamW learning rate)
def make_task(model: str, seed: int = 0, batch_size: int | None = None) -> Task:
    """The :class:`~.tasks.Task` for ``"gpt"``, ``"mlp"`` or a model of :data:`TASKS`."""
    if model == "gpt":
        return _gpt_task(seed, batch_size or 16)
    if model == "mlp":
        return _mlp_task(seed, batch_size or 64)
    if model in TASKS:
        return TASKS[model](seed, batch_size)
    raise ValueError(f"The 'model' parameter of make_task must be one of "
                     f"{('gpt', 'mlp', *TASKS)}. Got {model!r} instead.")


OPTIMIZERS: dict[str, tuple[Callable[[Any, float], torch.optim.Optimizer], float]] = {
    "adamw": (lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.01), 1.0),
    "sgd": (lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True), 30.0),
    "rmsprop": (lambda p, lr: torch.optim.RMSprop(p, lr=lr, alpha=0.99), 0.3),
    "adagrad": (lambda p, lr: torch.optim.Adagrad(p, lr=lr), 3.0),
}

PRECISIONS = ("fp32", "bf16", "fp16")


def make_optimizer(name: str, params: Iterable[Any], lr: float | None,
                   task_lr: float) -> torch.optim.Optimizer:
    """Optimizer ``name``; ``lr`` if given, else ``task_lr`` times the optimizer's factor.

    Examples
    --------
    >>> opt = make_optimizer("sgd", [torch.zeros(2, requires_grad=True)], None, 3e-3)
    >>> type(opt).__name__, round(opt.param_groups[0]["lr"], 4)
    ('SGD', 0.09)
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"The 'optimizer' parameter must be one of {tuple(OPTIMIZERS)}. "
                         f"Got {name!r} instead.")
    factory, factor = OPTIMIZERS[name]
    return factory(params, lr if lr else task_lr * factor)


def _step_decay(total: int, warmup: int) -> Callable[[int], float]:
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 1.0 if s < total // 2 else 0.3 if s < (4 * total) // 5 else 0.09
    return f


def _linear(total: int, warmup: int, floor: float = 0.1) -> Callable[[int], float]:
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        p = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - (1.0 - floor) * p
    return f


#: schedule name -> ``(total_steps, warmup_steps) -> (step -> LR multiplier)``
SCHEDULES: dict[str, Callable[[int, int], Callable[[int], float]]] = {
    "warmup_cosine": warmup_cosine,
    "constant": lambda total, warmup: (lambda s: 1.0),
    "step": _step_decay,
    "linear": _linear,
}


def make_schedule(name: str, steps: int) -> Callable[[int], float]:
    """LR multiplier function of schedule ``name`` over ``steps`` steps (10% warm-up).

    Examples
    --------
    >>> f = make_schedule("step", 100)
    >>> f(0), f(20), f(60), round(f(90), 2)
    (0.1, 1.0, 0.3, 0.09)
    """
    if name not in SCHEDULES:
        raise ValueError(f"The 'schedule' parameter must be one of {tuple(SCHEDULES)}. "
                         f"Got {name!r} instead.")
    return SCHEDULES[name](steps, max(1, steps // 10))


def precision_context(name: str, device: str = "cpu") -> tuple[Callable[[], Any], Any]:
    """``(autocast context factory, GradScaler or None)`` for precision ``name``.

    ``fp16`` uses autocast in float16 with a ``torch.amp.GradScaler(device)`` (initial scale
    2**12, so a short run sees both growth and overflow back-off).  ``device`` is the device
    type (``"cpu"`` or ``"cuda"``).
    """
    if name == "fp32":
        return contextlib.nullcontext, None
    if name == "bf16":
        return (lambda: torch.autocast(device, dtype=torch.bfloat16)), None
    if name == "fp16":
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=100)
        return (lambda: torch.autocast(device, dtype=torch.float16)), scaler
    raise ValueError(f"The 'precision' parameter must be one of {PRECISIONS}. "
                     f"Got {name!r} instead.")

