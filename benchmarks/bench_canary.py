"""Overhead of the canary set (``attach(..., canary=K, canary_loss=fn)``) per step.

Trains the same small MLP (batch 64, 256-wide) under the guard with and without a canary of
``K`` batches evaluated every ``N`` steps, and prints the median ``guard.offer_batch`` +
``guard.step`` time of ordinary steps, the mean extra time of an evaluation step, and the mean
per step over the run.  CPU, one torch thread.

    python benchmarks/bench_canary.py [--steps 400] [--k 4] [--every 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stability import Monitor
from stability.adapters.torch import TorchGuard


def run(steps: int, k: int, every: int) -> tuple[list[float], list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.functional.cross_entropy
    kw = ({"canary": k, "canary_loss": lambda m, b: loss_fn(m(b[0]), b[1]), "canary_every": every}
          if k else {})
    guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=0, **kw)
    g = torch.Generator().manual_seed(1)
    times, evals = [], []
    for _ in range(steps):
        x = torch.randn(64, 64, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        loss = loss_fn(model(x), y)
        loss.backward()
        t0 = time.perf_counter()
        guard.offer_batch((x, y))
        n = guard.canary.evaluations if guard.canary is not None else 0
        guard.step(loss)
        times.append(1e3 * (time.perf_counter() - t0))
        evals.append(int(guard.canary is not None and guard.canary.evaluations > n))
    return times, evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--every", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base, _ = run(a.steps, 0, a.every)
    with_c, ev = run(a.steps, a.k, a.every)
    warm = 10
    plain = [t for t, e in zip(with_c[warm:], ev[warm:], strict=True) if not e]
    at_eval = [t for t, e in zip(with_c[warm:], ev[warm:], strict=True) if e]
    b_med = statistics.median(base[warm:])
    print(f"canary K={a.k} every={a.every}, {a.steps} steps, MLP 64-256-256-10 batch 64, CPU")
    print("| | guard ms/step |")
    print("|---|---|")
    print(f"| no canary, median | {b_med:.3f} |")
    print(f"| canary, median of non-evaluation steps | {statistics.median(plain):.3f} |")
    print(f"| canary, mean of evaluation steps ({len(at_eval)}) | "
          f"{statistics.mean(at_eval) if at_eval else float('nan'):.3f} |")
    print(f"| mean over the run: no canary / canary | {statistics.mean(base[warm:]):.3f} / "
          f"{statistics.mean(with_c[warm:]):.3f} |")


if __name__ == "__main__":
    main()
