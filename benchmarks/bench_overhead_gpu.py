"""Cost of being attached on a GPU: guard overhead in a real, pipelined CUDA training loop.

``bench_overhead.py`` times single steps with a device synchronisation around each one, which
hides exactly what costs most on an accelerator: a host sync that stalls the queue.  Here a
bare loop and a guarded loop (same model, same initial weights, same batches) each run *blocks*
of ``--block`` steps with no synchronisation inside a block (the guard's own syncs, if any, are
the only ones), a ``torch.cuda.synchronize()`` closing each block; blocks alternate
bare/guarded (the order flipping every round) and the figure is the median per-step time over
``--rounds`` rounds.  So the overhead includes the pipeline bubbles the guard causes.

The guard runs with its defaults except ``checkpoint_every=0``: a periodic save (an in-memory
copy of weights and optimizer state, ~1.2 GB for the 98M model) would land in a timed block or
not, by chance; its cost is reported by the goodput ledger and spaced by the cadence advisor.

Per model x precision x guard mode it prints the bare and guarded ms/step, the overhead, host
syncs per step of each loop (counted with ``torch.cuda.set_sync_debug_mode("warn")``: every
synchronising CUDA call warns once), peak GPU memory of each loop, and the acting interventions
the guard took over all its steps (the runs are healthy: anything but 0 is a false alarm).

Precisions: ``fp32`` (TF32 off, PyTorch's default), ``bf16`` (autocast), ``fp16`` (autocast +
``GradScaler``, passed to the guard as ``scaler=``; the bare loop unscales/steps/updates it the
usual way).

Run (on a machine with CUDA)::

    python benchmarks/bench_overhead_gpu.py [--models big,big64,gpt124]
        [--precisions fp32,bf16,fp16]
        [--sync auto,step,deferred] [--rounds 7] [--block 20] [--fused]

``--sync auto`` (the default) is the guard's default: deferred with ``--fused`` (a fused AdamW on
CUDA), else step; the mode it resolved to is printed beside it (``auto>deferred``).

Target (issue 17): <= 3% of the step on the >= 10M-parameter model with the default guard.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench_overhead import BigLM  # noqa: E402
from torch import nn  # noqa: E402

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402

#: name -> (model kwargs, rows, ctx, lr)
MODELS: dict[str, tuple[dict[str, int], int, int, float]] = {
    "big": ({}, 4, 32, 3e-4),  # bench_overhead.py's 12.9M model and batch (4 x 32 tokens)
    "big64": ({}, 64, 64, 3e-4),  # the same model, 64 x 64 tokens
    "gpt124": ({"vocab": 8192, "ctx": 256, "d": 768, "n_layer": 12, "n_head": 12}, 16, 256,
               3e-4),  # GPT-2-small shape (~98M parameters with this vocabulary)
    "gpt124L": ({"vocab": 8192, "ctx": 1024, "d": 768, "n_layer": 12, "n_head": 12}, 16, 1024,
                3e-4),  # the same, nanoGPT's micro-batch: 16 x 1024 tokens
    "gpt124XL": ({"vocab": 8192, "ctx": 1024, "d": 768, "n_layer": 12, "n_head": 12}, 64, 1024,
                 3e-4),  # the same, 64 x 1024 tokens: a step the GPU, not Python, bounds
}


def make(name: str, device: torch.device) -> tuple[nn.Module, list[tuple[torch.Tensor,
                                                                        torch.Tensor]], float]:
    """Model (seeded) and 8 fixed batches on ``device``."""
    kw, rows, ctx, lr = MODELS[name]
    torch.manual_seed(0)
    model = BigLM(**kw).to(device)
    vocab = kw.get("vocab", 256)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, vocab, (8, rows, ctx + 1), generator=gen).to(device)
    return model, [(d[:, :-1], d[:, 1:]) for d in data], lr


class Loop:
    """One training loop (bare or guarded) over the shared batches."""

    def __init__(self, name: str, precision: str, device: torch.device, guarded: bool,
                 sync: str = "auto", fused: bool = False) -> None:
        self.model, self.batches, lr = make(name, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01,
                                     fused=fused or None)
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.guard: TorchGuard | None = None
        self.i = 0
        if guarded:
            # no periodic checkpoint inside the timed blocks: a save (an in-memory copy of the
            # weights and optimizer state) is a separate, amortised cost -- the goodput ledger
            # reports it, the cadence advisor spaces it
            kw: dict[str, Any] = {"log_interventions": False, "scaler": self.scaler,
                                  "checkpoint_every": 0}
            if "sync" in inspect.signature(TorchGuard).parameters:
                kw["sync"] = sync
            elif sync not in ("step", "auto"):  # (its only mode, and its default, is step)
                raise SystemExit("this TorchGuard has no sync= option")
            self.guard = TorchGuard(self.model, self.opt, monitor=Monitor("default"), **kw)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        ctx = (torch.autocast("cuda", dtype=self.dtype) if self.dtype is not None
               else contextlib.nullcontext())
        with ctx:
            logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.guard is not None:
            self.guard.step(loss)
            return
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def acting(self) -> int:
        if self.guard is None:
            return 0
        flush = getattr(self.guard, "flush", None)
        if callable(flush):
            flush()
        return sum(1 for i in self.guard.interventions if getattr(i, "type", "") != "alert")


def count_syncs(loop: Loop, steps: int = 3) -> float:
    """Synchronising CUDA calls per step (``set_sync_debug_mode('warn')``)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                loop.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(x.message) for x in w) / steps


def timed_block(loop: Loop, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        loop.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def peak_mem(loop: Loop, n: int = 3) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(n):
        loop.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench(name: str, precision: str, sync: str, rounds: int, block: int,
          device: torch.device, fused: bool = False) -> dict[str, Any]:
    bare = Loop(name, precision, device, guarded=False, fused=fused)
    guarded = Loop(name, precision, device, guarded=True, sync=sync, fused=fused)
    for loop in (bare, guarded):  # warm-up: kernels, allocator, Numba, cuBLAS handles
        for _ in range(block):
            loop.step()
    tb: list[float] = []
    tg: list[float] = []
    for r in range(rounds):
        pair = ((bare, tb), (guarded, tg))
        for loop, ts in pair if r % 2 == 0 else pair[::-1]:
            ts.append(timed_block(loop, block))
    mb, mg = peak_mem(bare), peak_mem(guarded)
    sb, sg = count_syncs(bare), count_syncs(guarded)
    b, g = statistics.median(tb), statistics.median(tg)
    n_params = sum(p.numel() for p in bare.model.parameters())
    kw, rows, ctx, _ = MODELS[name]
    if sync == "auto":  # the mode the guard resolved to at its first step
        sync = f"auto>{getattr(guarded.guard, 'sync_mode', 'step')}"
    return {"model": name + (" fused" if fused else ""), "params": n_params,
            "tokens": rows * ctx, "precision": precision,
            "sync": sync, "bare_ms": 1e3 * b, "guard_ms": 1e3 * g, "overhead": (g - b) / b,
            "spread": (max(tg) - min(tg)) / g, "syncs_bare": sb, "syncs_guard": sg,
            "mem_bare": mb, "mem_guard": mg, "acting": guarded.acting(),
            "steps": guarded.i}


def profile_guard(name: str, precision: str, sync: str, device: torch.device,
                  steps: int = 10, fused: bool = False) -> None:
    """Top host-side ops of ``guard.step`` (torch profiler, ``steps`` steps, warm)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    loop = Loop(name, precision, device, guarded=True, sync=sync, fused=fused)
    for _ in range(20):
        loop.step()
    guard = loop.guard
    assert guard is not None
    inner = guard.step

    def step(loss: Any, metrics: Any = None) -> Any:
        with record_function("guard.step"):
            return inner(loss, metrics)

    guard.step = step  # type: ignore[method-assign]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    guard.step = inner  # type: ignore[method-assign]
    per_op: dict[str, list[float]] = {}
    guard_us = 0.0
    for e in prof.events():
        if e.name == "guard.step":
            guard_us += e.cpu_time_total
        chain, p = [], e.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        if "guard.step" in chain and not any(c.startswith("Optimizer.") for c in chain):
            row = per_op.setdefault(e.name, [0.0, 0.0])
            row[0] += e.self_cpu_time_total
            row[1] += 1
    print(f"profile {name} {precision} {sync}: guard.step {guard_us / steps / 1e3:.2f} ms host "
          "per step (optimizer.step inside it included); the guard's own ops (self host time "
          "per step, calls per step):")
    for op, (us, n) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:18]:
        print(f"  {op:<44}{us / steps / 1e3:8.3f} ms{n / steps:8.1f}")


def main(argv: list[str] | None = None) -> int:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady state: kernels compiled before timing
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="big,big64,gpt124")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--sync", default="auto",
                    help="comma list of guard sync modes (auto, the guard's default; step; "
                    "deferred)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--fused", action="store_true",
                    help="AdamW(fused=True) in both loops (else PyTorch's default, foreach)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="MODEL:PRECISION[:SYNC]",
                    help="only print a torch-profiler table of the guarded loop")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead_gpu.py needs CUDA")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"blocks of {a.block} steps x {a.rounds} rounds, alternating", flush=True)
    if a.profile:
        parts = a.profile.split(":")
        profile_guard(parts[0], parts[1], parts[2] if len(parts) > 2 else "auto", device,
                      fused=a.fused)
        return 0
    rows = []
    for name in a.models.split(","):
        for prec in a.precisions.split(","):
            for sync in a.sync.split(","):
                r = bench(name, prec, sync, a.rounds, a.block, device, a.fused)
                rows.append(r)
                print(f"{r['model']:<14}{r['params']:>12,}{r['tokens']:>7} tok {prec:<5}"
                      f"{r['sync']:<14}bare {r['bare_ms']:7.2f} ms  guarded {r['guard_ms']:7.2f} ms"
                      f"  overhead {100 * r['overhead']:6.1f}% (spread {100 * r['spread']:.1f}%)"
                      f"  syncs/step {r['syncs_bare']:.1f} -> {r['syncs_guard']:.1f}"
                      f"  mem +{(r['mem_guard'] - r['mem_bare']) / 2**20:.1f} MiB"
                      f"  acting {r['acting']}/{r['steps']} steps", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
