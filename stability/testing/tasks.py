"""The tiny problems of :mod:`.tinytrain`: data, models and :class:`Task` factories.

* ``"gpt"`` -- a 2-layer character-level GPT (:class:`TinyGPT`) trained on Python
  standard-library source text, read from the local files of stdlib modules
  (``inspect.getsourcefile``);
* ``"mlp"`` -- a 3-layer :class:`MLP` classifying synthetic data labelled by a random teacher
  network.

More architectures are registered in :data:`.models.TASKS`; :func:`.models.make_task` builds
any of them by name. Batch ``i`` of a task is a pure function of ``(seed, i)``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Task", "TinyGPT", "prose_text", "stdlib_text", "warmup_cosine"]


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

