"""Does the monitor save runs?  Tiny models really trained on CPU with real faults injected.

For every fault kind and seed, the same run (same seed, same fault at the same random step) is
trained four ways: no monitor, a fixed-clip baseline (``clip_grad_norm_`` at 1.0), the monitor
with its default policy, and the monitor with the ``rescue`` policy override below.  A run is
*rescued* when its final held-out loss is within 5% of the clean run of the same seed; a run
*failed* without the monitor when it is not.  Clean runs with the monitor attached count the
interventions a healthy run receives (must be 0).

Usage::

    python benchmarks/bench_rescue.py            # default size (~5-8 min on 2 cores)
    python benchmarks/bench_rescue.py --quick    # CI size (~1-2 min)

Options: ``--models mlp,gpt``, ``--seeds N``, ``--workers N``, ``--preset small``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from typing import Any

FAULTS = ("lr_blowup", "schedule_bug", "data_corruption", "bit_flip", "grad_explosion")
VARIANTS = ("none", "clip", "monitor", "rescue")
FIXED_CLIP = 1.0

#: Policy override used by the ``rescue`` variant (see the module docstring of the report).
#: Validation spikes and sustained loss level shifts that follow an incident are fault evidence:
#: they escalate and go straight to checkpoint + rollback (level 3).
RESCUE_POLICY: dict[str, Any] = {
    "kinds": {
        "train_val_divergence": {"escalate": True, "start_level": 3, "ladder": None},
        "level_shift": {"escalate": True, "start_level": 3, "ladder": None},
    },
}


def _monitor(preset: str, variant: str) -> Any:
    from stability.monitor import Monitor

    if variant == "rescue":
        return Monitor({"preset": preset, "policy": RESCUE_POLICY})
    return Monitor(preset)


def _job(args: tuple[str, int, int, str | None, int, str, str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from stability.testing.tinytrain import FaultSpec, train_run

    model, steps, seed, kind, onset, variant, preset = args
    fault = None if kind is None else FaultSpec(kind, onset)
    kw: dict[str, Any] = {}
    if variant == "clip":
        kw["clip_norm"] = FIXED_CLIP
    if variant in ("monitor", "rescue"):
        kw["monitor"] = _monitor(preset, variant)
    r = train_run(model, steps, seed=seed, fault=fault, **kw)
    return {
        "model": model, "seed": seed, "kind": kind or "clean", "variant": variant,
        "final": r.final_loss, "rollbacks": r.rollbacks, "lost": r.steps_lost,
        "skipped": r.steps_skipped, "acting": len(r.acting_interventions()),
        "stopped": r.stopped, "step_s": r.step_time_s, "iters": r.iterations,
        "types": sorted({i.type for i in r.acting_interventions()}),
    }


def _overhead(model: str, steps: int, preset: str) -> tuple[float, float, float]:
    """Median per-step time: bare loop, guard without monitor, guard with monitor (warm JIT)."""
    import torch

    torch.set_num_threads(1)
    from stability.testing.tinytrain import train_run

    train_run(model, 60, seed=0, monitor=_monitor(preset, "monitor"))  # compile / warm up
    bare, sig, mon = [], [], []
    for rep in range(3):
        bare.append(train_run(model, steps, seed=rep, eval_every=0).step_time_s)
        sig.append(train_run(model, steps, seed=rep, eval_every=0,
                             recorder=_NullRecorder()).step_time_s)
        mon.append(train_run(model, steps, seed=rep, eval_every=0,
                             monitor=_monitor(preset, "monitor")).step_time_s)
    med = sorted
    return med(bare)[1], med(sig)[1], med(mon)[1]


class _NullRecorder:
    def log(self, step: int, metrics: Any) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size")
    ap.add_argument("--models", default=None, help="comma list of mlp,gpt")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--preset", default="small")
    a = ap.parse_args(argv)
    models = (a.models or ("mlp" if a.quick else "mlp,gpt")).split(",")
    n_seeds = a.seeds or (2 if a.quick else 3)
    steps = {"mlp": 300 if a.quick else 400, "gpt": 120 if a.quick else 150}
    jobs = []
    for model in models:
        n = steps[model]
        for seed in range(n_seeds):
            rng = random.Random(1000 * seed + len(model))
            for v in ("none", "monitor"):
                jobs.append((model, n, seed, None, 0, v, a.preset))
            for kind in FAULTS:
                onset = rng.randint(int(0.4 * n), int(0.6 * n))  # random step, after warm-up
                for v in VARIANTS:
                    jobs.append((model, n, seed, kind, onset, v, a.preset))
    t0 = time.perf_counter()
    print(f"bench_rescue: {len(jobs)} runs, models={models}, seeds={n_seeds}, "
          f"workers={a.workers}, preset={a.preset}", flush=True)
    with ProcessPoolExecutor(a.workers) as ex:
        results = list(ex.map(_job, jobs))
    clean = {(r["model"], r["seed"]): r["final"] for r in results
             if r["kind"] == "clean" and r["variant"] == "none"}

    def ok(r: dict[str, Any]) -> bool:
        c = clean[(r["model"], r["seed"])]
        return math.isfinite(r["final"]) and abs(r["final"] / c - 1.0) <= 0.05

    by: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in results:
        by[(r["model"], r["kind"])][r["variant"]].append(r)
    hdr = (f"{'model':5} {'fault':15} {'failed':>6} {'NaN':>4} {'clip ok':>7} "
           f"{'mon rescued':>11} {'rescue-pol':>10} {'rb':>3} {'lost':>5} {'skip':>5}  actions")
    print(hdr)
    print("-" * len(hdr))
    tot = defaultdict(int)
    for model in models:
        for kind in FAULTS:
            g = by[(model, kind)]
            pairs = list(zip(g["none"], g["clip"], g["monitor"], g["rescue"], strict=False))
            failed = [p for p in pairs if not ok(p[0])]
            nan = sum(not math.isfinite(p[0]["final"]) for p in pairs)
            clip_ok = sum(ok(p[1]) for p in failed)
            mon_ok = sum(ok(p[2]) for p in failed)
            res_ok = sum(ok(p[3]) for p in failed)
            rb = sum(p[3]["rollbacks"] for p in pairs)
            lost = sum(p[3]["lost"] for p in pairs)
            skip = sum(p[3]["skipped"] for p in pairs)
            acts = sorted({t for p in pairs for t in p[3]["types"]})
            tot["failed"] += len(failed)
            tot["clip"] += clip_ok
            tot["mon"] += mon_ok
            tot["res"] += res_ok
            print(f"{model:5} {kind:15} {len(failed):>3}/{len(pairs):<2} {nan:>4} "
                  f"{clip_ok:>7} {mon_ok:>8}/{len(failed):<2} {res_ok:>7}/{len(failed):<2} "
                  f"{rb:>3} {lost:>5} {skip:>5}  {','.join(acts)}")
    print("-" * len(hdr))
    f = max(1, tot["failed"])
    print(f"otherwise-failing runs: {tot['failed']}; rescued by fixed clip {tot['clip']} "
          f"({100 * tot['clip'] / f:.0f}%), monitor default policy {tot['mon']} "
          f"({100 * tot['mon'] / f:.0f}%), monitor rescue policy {tot['res']} "
          f"({100 * tot['res'] / f:.0f}%)")
    for v in ("monitor",):
        cl = [r for r in results if r["kind"] == "clean" and r["variant"] == v]
        n_int = sum(r["acting"] for r in cl)
        worst = max(abs(r["final"] / clean[(r["model"], r["seed"])] - 1) for r in cl)
        print(f"clean runs with monitor: {len(cl)}, interventions {n_int}, "
              f"max |final loss change| {100 * worst:.2f}%")
    print(f"runs took {time.perf_counter() - t0:.0f} s wall")
    for model in models:
        b, s, m = _overhead(model, 120 if a.quick else 200, a.preset)
        print(f"overhead {model}: bare step {1e3 * b:.2f} ms, + signals {1e3 * (s - b):+.2f} ms "
              f"({100 * (s / b - 1):+.1f}%), + signals & monitor {1e3 * (m - b):+.2f} ms "
              f"({100 * (m / b - 1):+.1f}%)")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
