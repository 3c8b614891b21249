"""Overhead of the canary set (``attach(..., canary=K, canary_loss=fn)``) per step.

Trains the same small MLP (batch 64, 256-wide) under the guard with and without a canary of
``K`` batches evaluated every ``N`` steps, and prints the median ``guard.offer_batch`` +
``guard.step`` time of ordinary steps, the mean extra time of an evaluation step, and the mean
per step over the run.  CPU, one torch thread.

    python benchmarks/bench_canary.py [--steps 400] [--k 4] [--every 50]

``--hf``: the HF Trainer's default-on canary instead -- a tiny GPT-2 (2 layers, 64 wide, byte
vocabulary, sequences of 64) trained by a real ``transformers.Trainer`` on CPU with
``StabilityTrainerCallback(canary=K, canary_every=N)`` and with ``canary=0``; prints the
callback's own time per step (``overhead_s``: measuring, deciding, the canary evaluations),
the time of the whole ``train()`` and whether the final weights are bit-identical.
"""

from __future__ import annotations

import argparse
import math
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


def hf_run(steps: int, k: int, every: int
           ) -> tuple[float, float, int, list[torch.Tensor], float]:
    """One HF Trainer run; returns (train() seconds, callback ms/step, evaluations, weights,
    ms of one canary evaluation timed after training)."""
    import tempfile

    import transformers

    from stability.adapters.hf import StabilityTrainerCallback

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1)
            base = torch.randint(0, 256, (steps * 8, 65), generator=g)
            self.ids = torch.cumsum(base, 1) % 256  # learnable structure: running sums

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i, :64], "labels": self.ids[i, :64]}

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(
            d, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
            max_grad_norm=1.0, logging_steps=50, save_strategy="no", report_to=[],
            use_cpu=True, disable_tqdm=True, seed=0, data_seed=0, dataloader_num_workers=0)
        cb = StabilityTrainerCallback(Monitor("small"), canary=k, canary_every=every)
        tr = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                  callbacks=[cb])
        tr.remove_callback(transformers.trainer_callback.PrinterCallback)
        t0 = time.perf_counter()
        tr.train()
        wall = time.perf_counter() - t0
    assert cb.guard is not None
    evals = cb.guard.canary.evaluations if cb.guard.canary is not None else 0
    per_step = 1e3 * cb.overhead_s / max(1, cb.overhead_steps)
    weights = [p.detach().clone() for p in model.parameters()]
    eval_ms = math.nan
    if cb.guard.canary is not None:  # (after training: the run's numbers are taken)
        t0 = time.perf_counter()
        for _ in range(5):
            cb.guard.canary.evaluate(model)
        eval_ms = 1e3 * (time.perf_counter() - t0) / 5
    return wall, per_step, evals, weights, eval_ms


def hf_main(steps: int, k: int, every: int) -> None:
    hf_run(20, 0, every)  # warm-up (imports, first-call costs)
    off = hf_run(steps, 0, every)
    on = hf_run(steps, k, every)
    same = all(torch.equal(a, b) for a, b in zip(on[3], off[3], strict=True))
    print(f"HF Trainer, tiny GPT-2 (2x64, seq 64, batch 8), {steps} steps, canary K={k} "
          f"every={every}, CPU 1 thread")
    print("| | train() s | callback ms/step | canary evaluations |")
    print("|---|---|---|---|")
    print(f"| canary=0 | {off[0]:.2f} | {off[1]:.3f} | {off[2]} |")
    print(f"| canary={k} | {on[0]:.2f} | {on[1]:.3f} | {on[2]} |")
    print(f"one canary evaluation ({k} forward passes): {on[4]:.2f} ms; "
          f"final weights bit-identical: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--hf", action="store_true", help="the HF Trainer's default-on canary")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.hf:
        hf_main(a.steps, a.k, a.every)
        return
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
