"""Dispatched torch ops per guarded step, against the bare step (``bench_overhead.py --ops``).

On an accelerator a short step is bounded by the host: every eager op costs a dispatch and
usually a kernel launch, so the guard's host cost is about proportional to the number of ops it
dispatches.  Counted here on the CPU with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
(every ATen op that reaches the dispatcher from Python-level code, views included, each
``_foreach_*`` call counting once): a bare loop (forward, backward, ``optimizer.step()``,
``zero_grad``) and a guarded loop (forward, backward, ``guard.step(loss)``) of the same model,
step by step over two cadence windows (the least common multiple of ``update_ratio_every`` and
``param_norm_every``: 4 steps).  The guard's ops per step are the difference, averaged over the
window, with the least and most of one step.

Model rows: ``bench_overhead.py``'s models plus two GPTs with 150 parameter tensors -- the
tensor count of ``bench_overhead_gpu.py``'s ``gpt124`` (12 blocks), shrunk to CPU size:
``gpt150`` (width 64: its weight matrices are larger than the 4096-element update-ratio sample,
as a real GPT's are) and ``tiny150`` (width 8: every tensor is tiny, so that compute is
negligible and the host's per-op cost is all there is -- the CPU stand-in for a launch-bound GPU
step; ``bench_overhead.py --models tiny150`` times its guard work in microseconds).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "guard_ops", "run_ops"]


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched while :attr:`active`, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if self.active:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> int:
        """Ops counted since the last call (then reset)."""
        n = sum(self.ops.values())
        self.ops.clear()
        return n


def guard_ops(make: Callable[[], torch.nn.Module], batch: Callable[[int], Any],
              loss_fn: Callable[..., torch.Tensor], lr: float, guard_factory: Callable[..., Any],
              warmup: int = 4, fused: bool = False) -> dict[str, Any]:
    """Ops per step of a bare and a guarded loop of one model (see the module docstring).

    ``guard_factory(model, optimizer)`` builds the guard; ``fused``: ``AdamW(fused=True)``
    in both loops (else PyTorch's default).  Returns ``bare`` and ``guarded``
    (lists of ops per step), ``guard`` (per-step differences), ``mean`` / ``lo`` / ``hi`` of
    those, the parameter tensor count ``tensors`` and the ``top`` guard ops over the window.
    """
    bare, guarded = make(), make()
    guarded.load_state_dict(bare.state_dict())
    opt_b = torch.optim.AdamW(bare.parameters(), lr=lr, weight_decay=0.01, fused=fused or None)
    opt_g = torch.optim.AdamW(guarded.parameters(), lr=lr, weight_decay=0.01,
                              fused=fused or None)
    guard = guard_factory(guarded, opt_g)
    col = guard.collector
    k = math.lcm(max(1, col.update_ratio_every), max(1, col.param_norm_every))
    counts: dict[str, list[int]] = {"bare": [], "guarded": []}
    top: Counter[str] = Counter()
    loop_ops: Counter[str] = Counter()
    for i in range(warmup + 2 * k):
        x, y = batch(i)
        for name, model in (("bare", bare), ("guarded", guarded)):
            with OpCounter() as c:
                loss = loss_fn(model, x, y)
                loss.backward()
                n = c.take()  # forward + backward
                if name == "bare":
                    opt_b.step()
                    opt_b.zero_grad(set_to_none=True)
                    loop_ops = Counter(c.ops)  # the loop's own: optimizer step, zero_grad
                else:
                    guard.step(loss)
                    if i >= warmup:  # the guard's own ops (its optimizer step subtracted)
                        top.update(c.ops)
                        top.subtract(loop_ops)
                n += c.take()
            if i >= warmup:
                counts[name].append(n)
    detach = getattr(guard, "detach", None)
    if callable(detach):
        detach()
    diff = [g - b for g, b in zip(counts["guarded"], counts["bare"], strict=True)]
    return {**counts, "guard": diff, "mean": statistics.fmean(diff), "lo": min(diff),
            "hi": max(diff), "tensors": len(list(guarded.parameters())), "every": k,
            "top": [(op, n) for op, n in top.most_common() if n > 0][:8]}


def print_ops(rows: list[dict[str, Any]], fused: bool = False) -> None:
    """The ``--ops`` table."""
    print("dispatched ATen ops per step (TorchDispatchMode; bare = forward + backward + AdamW"
          f"{'(fused=True)' if fused else ''} step + zero_grad, guarded = forward + backward + "
          "guard.step; guard = the difference, "
          "mean over two cadence windows [least, most of one step])")
    print(f"{'model':<12}{'sync':<10}{'tensors':>8}{'bare':>8}{'guarded':>9}{'guard':>8}"
          f"{'range':>12}   top guard ops over the window")
    for r in rows:
        top = ", ".join(f"{op.replace('aten.', '')} {n}" for op, n in r["top"][:4])
        print(f"{r['model']:<12}{r['sync']:<10}{r['tensors']:>8}"
              f"{statistics.fmean(r['bare']):>8.1f}{statistics.fmean(r['guarded']):>9.1f}"
              f"{r['mean']:>8.1f}{'[' + str(r['lo']) + ', ' + str(r['hi']) + ']':>12}   {top}")


def run_ops(models: list[str], syncs: list[str], setup: Callable[[str], Any],
            fused: bool = False) -> list[dict[str, Any]]:
    """Count and print the ops of each model (``setup(name)`` as in ``bench_overhead.py``) under
    each guard ``sync`` mode, with the default guard (``Monitor("default")``)."""
    from stability.adapters.torch import TorchGuard
    from stability.monitor.monitor import Monitor

    torch.set_num_threads(1)
    rows = []
    for name in models:
        make, batch, loss_fn, lr = setup(name)
        for sync in syncs:
            def factory(m: torch.nn.Module, opt: Any, sync: str = sync) -> Any:
                return TorchGuard(m, opt, monitor=Monitor("default"), log_interventions=False,
                                  sync=sync)
            rows.append({"model": name, "sync": sync,
                         **guard_ops(make, batch, loss_fn, lr, factory, fused=fused)})
    print_ops(rows, fused)
    return rows
