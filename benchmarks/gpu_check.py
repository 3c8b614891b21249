"""The GPU check: one script to run whenever a GPU is available (<= 8 minutes on one GPU).

It measures and checks, on the GPU, what the CPU test suite cannot:

1. **Overhead** of the guard (``sync="auto"``, fused AdamW) on a GPT-2-124M-shaped model
   (``bench_overhead_gpu.py``'s ``gpt124``: 12 layers, d=768, 16 x 256 tokens) in bf16 and fp16
   (autocast + CUDA ``GradScaler``): bare vs guarded ms/step (median of alternating blocks),
   host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``), peak memory, and the
   acting interventions on this healthy run (anything but 0 is a false alarm).
2. **Rescues** on the GPU with ``stability.testing.tinytrain``: an LR x50 blow-up (gpt, bf16) and
   a weight corruption (a bit flip, mlp, fp32): the guarded run ends within 5% of the clean run
   (the broken one does not), and its first acting intervention (type and step) is compared
   with the same run on the CPU ("same decisions as on CPU": reported, and required for the
   fp32 bit flip, where both devices see the same corruption of the same weight).
3. **Trainers with their real CUDA scalers**: HF ``Trainer(fp16=True)`` and Lightning
   ``precision="16-mixed"`` (``tests/adapters/test_trainer_deferred_cuda.py``: healthy runs
   untouched, no host sync on the step path, NaN gradients kept from the weights) and the
   guard's own CUDA tests (``tests/adapters/test_cuda.py``), run with pytest.

It prints one markdown table (paste it into docs/BENCHMARKS.md with the date and the GPU) and
exits 1 when a check fails.  Without CUDA it prints ``no GPU: skipped`` and exits 0.

Run::

    python benchmarks/gpu_check.py                 # on a machine with a GPU
    python benchmarks/gpu_check.py --device cpu --tiny   # exercise every code path on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

#: wall-clock budget of the whole check (the trainer tests get what is left, at most 240 s)
BUDGET_S = 480.0
#: model shapes: (BigLM kwargs, rows, ctx, lr)
SHAPES: dict[str, tuple[dict[str, int], int, int, float]] = {
    "gpt124": ({"vocab": 8192, "ctx": 256, "d": 768, "n_layer": 12, "n_head": 12}, 16, 256, 3e-4),
    "tiny": ({"vocab": 256, "ctx": 32, "d": 64, "n_layer": 2, "n_head": 2}, 4, 32, 3e-4),
}


@dataclass
class Row:
    """One line of the table."""

    check: str
    result: str
    ok: bool | None  #: ``None``: a measurement, not a pass/fail check


# ---------------------------------------------------------------------------- device helpers
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _count_syncs(device: Any, out: list[int]) -> Any:
    """Count synchronising CUDA calls in the block (nothing to count on a CPU)."""
    import torch

    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out.append(sum("synchroniz" in str(x.message) for x in w))


# ---------------------------------------------------------------------------- 1. overhead
class Loop:
    """A bare or guarded training loop of a ``BigLM`` over 8 fixed batches."""

    def __init__(self, shape: str, precision: str, device: Any, guarded: bool) -> None:
        import torch
        from bench_overhead import BigLM

        from stability.adapters.torch import TorchGuard
        from stability.monitor.monitor import Monitor

        kw, rows, ctx, lr = SHAPES[shape]
        torch.manual_seed(0)
        self.model = BigLM(**kw).to(device)
        gen = torch.Generator().manual_seed(1)
        data = torch.randint(0, kw["vocab"], (8, rows, ctx + 1), generator=gen).to(device)
        self.batches = [(d[:, :-1], d[:, 1:]) for d in data]
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01,
                                     fused=fused or None)
        self.device = device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        self.scaler = (torch.amp.GradScaler(device.type) if precision == "fp16" else None)
        self.guard = None
        if guarded:  # periodic saves are a separate, amortised cost (goodput ledger)
            self.guard = TorchGuard(self.model, self.opt, monitor=Monitor("default"),
                                    scaler=self.scaler, checkpoint_every=0, sync="auto",
                                    log_interventions=False)
        self.i = 0

    def step(self) -> None:
        import torch

        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        ctx = (torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None
               else contextlib.nullcontext())
        with ctx:
            logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
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

    def block(self, n: int) -> float:
        """Seconds per step over ``n`` steps with no synchronisation inside."""
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        _sync(self.device)
        return (time.perf_counter() - t0) / n

    def acting(self) -> int:
        if self.guard is None:
            return 0
        self.guard.flush()
        return sum(1 for i in self.guard.interventions if getattr(i, "type", "") != "alert")


def _peak_mib(loop: Loop) -> float:
    import torch

    if loop.device.type != "cuda":
        return math.nan
    _sync(loop.device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        loop.step()
    _sync(loop.device)
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def overhead(shape: str, precision: str, device: Any, rounds: int, block: int) -> list[Row]:
    """Bare vs guarded loop: ms/step, host syncs per step, peak memory, acting interventions."""
    bare, guarded = (Loop(shape, precision, device, g) for g in (False, True))
    for loop in (bare, guarded):  # warm-up: kernels, allocator, Numba
        loop.block(block)
    tb: list[float] = []
    tg: list[float] = []
    for r in range(rounds):
        pair = [(bare, tb), (guarded, tg)]
        for loop, ts in pair if r % 2 == 0 else pair[::-1]:
            ts.append(loop.block(block))
    syncs: dict[str, list[int]] = {"bare": [], "guard": []}
    for name, loop in (("bare", bare), ("guard", guarded)):
        for _ in range(3):
            with _count_syncs(device, syncs[name]):
                loop.step()
    b, g = statistics.median(tb), statistics.median(tg)
    mode = getattr(guarded.guard, "sync_mode", "?")
    per_step = (f"{statistics.mean(syncs['bare']):.1f} -> {statistics.mean(syncs['guard']):.1f}"
                if syncs["guard"] else "n/a (cpu)")
    mem = (f"{_peak_mib(bare):.0f} -> {_peak_mib(guarded):.0f} MiB" if device.type == "cuda"
           else "n/a (cpu)")
    acting = guarded.acting()
    n = sum(p.numel() for p in bare.model.parameters())
    label = f"overhead {shape} ({n / 1e6:.1f}M params) {precision} auto>{mode}"
    return [Row(label, f"{1e3 * b:.2f} -> {1e3 * g:.2f} ms/step ({100 * (g - b) / b:+.1f}%); "
                       f"host syncs/step {per_step}; peak {mem}", None),
            Row(f"{label}: healthy run untouched", f"{acting} acting interventions",
                acting == 0)]


# ---------------------------------------------------------------------------- 2. rescues
def _first_acting(res: Any) -> tuple[str, int] | None:
    acts = res.acting_interventions()
    return (acts[0].type, int(acts[0].step)) if acts else None


def rescue(kind: str, device: str, tiny: bool) -> list[Row]:
    """A fault on ``device``: clean, broken and guarded runs; the guard's first action vs CPU."""
    from stability.monitor.monitor import Monitor
    from stability.testing.tinytrain import FaultSpec, train_run

    if kind == "lr_x50":
        model, steps, seed, prec = "gpt", 150, 1, "bf16"
        fault = FaultSpec("lr_blowup", 60, duration=10, magnitude=50.0)
    else:
        model, steps, seed, prec = "mlp", 200, 0, "fp32"
        fault = FaultSpec("bit_flip", 80, duration=1, magnitude=30)
    if tiny:
        steps = 120 if model == "gpt" else steps

    def run(dev: str, **kw: Any) -> Any:
        return train_run(model, steps, seed=seed, precision=prec, device=dev, **kw)

    clean = run(device)
    broken = run(device, fault=fault)
    saved = run(device, fault=fault, monitor=Monitor("small", alert_sinks=[]))
    on_cpu = saved if device == "cpu" else run(
        "cpu", fault=fault, monitor=Monitor("small", alert_sinks=[]))
    hurt = not math.isfinite(broken.final_loss) or broken.final_loss > 1.05 * clean.final_loss
    ok = math.isfinite(saved.final_loss) and saved.final_loss <= 1.05 * clean.final_loss
    first, first_cpu = _first_acting(saved), _first_acting(on_cpu)
    same = first == first_cpu
    label = f"rescue {kind} ({model}, {prec}, {device})"
    return [Row(f"{label}: saved", f"loss clean {clean.final_loss:.3f}, broken "
                                   f"{broken.final_loss:.3f}, guarded {saved.final_loss:.3f} "
                                   f"({saved.rollbacks} rollbacks)", hurt and ok),
            Row(f"{label}: first action vs cpu", f"{first} vs {first_cpu}",
                same if prec == "fp32" else None)]


# ---------------------------------------------------------------------------- 3. trainers
def trainer_tests(device: str, budget: float) -> list[Row]:
    """HF fp16 / Lightning 16-mixed with their CUDA scalers, and the guard's CUDA tests."""
    if device != "cuda":
        return [Row("trainers with CUDA scalers (HF fp16, Lightning 16-mixed)",
                    "skipped: needs CUDA", None)]
    files = ["tests/adapters/test_trainer_deferred_cuda.py", "tests/adapters/test_cuda.py"]
    out = []
    for f in files:
        limit = max(30.0, budget / len(files))
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-m", "pytest", f, "-q", "-p", "no:cacheprovider"],
                               cwd=ROOT, capture_output=True, text=True, timeout=limit,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
            last = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
            out.append(Row(f"pytest {f}", f"{last} ({time.perf_counter() - t0:.0f} s)",
                           p.returncode == 0))
        except subprocess.TimeoutExpired:
            out.append(Row(f"pytest {f}", f"timed out after {limit:.0f} s", False))
    return out


# ---------------------------------------------------------------------------- main
def table(rows: list[Row]) -> str:
    """The markdown table."""
    mark = {True: "pass", False: "**FAIL**", None: ""}
    lines = ["| check | result | |", "|---|---|---|"]
    lines += [f"| {r.check} | {r.result} | {mark[r.ok]} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model and short blocks (exercises the code paths on a CPU)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("no torch: skipped")
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no GPU: skipped (run on a machine with CUDA, or --device cpu --tiny to exercise "
              "the code paths)")
        return 0
    from detectors import dispatch

    dispatch.set_mode("blocking")  # kernels compiled before timing
    device = torch.device(a.device)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# GPU check: {name} | torch {torch.__version__} | {time.strftime('%Y-%m-%d')}",
          flush=True)
    shape = "tiny" if a.tiny else "gpt124"
    rounds, block = (2, 3) if a.tiny else (a.rounds, a.block)
    rows: list[Row] = []
    precs = ("bf16", "fp16") if a.device == "cuda" else ("bf16",)
    for prec in precs:
        rows += overhead(shape, prec, device, rounds, block)
        print(f"  overhead {prec} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for kind in ("lr_x50", "bit_flip"):
        rows += rescue(kind, a.device, a.tiny)
        print(f"  rescue {kind} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows += trainer_tests(a.device, min(240.0, BUDGET_S - (time.perf_counter() - t0)))
    print(table(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
