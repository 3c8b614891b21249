"""Soak test: millions of ``Monitor.observe()`` steps, memory must stay flat, step time stable.

A realistic LLM configuration: the ``llm_pretrain`` preset (13 bindings, policy included), ~20
scalar metrics per step, per-layer families through the ``declare_family`` fast path (grad norms,
update ratios and 4 activation statistics for ``--layers`` layers), ``val_loss`` every 1000 steps,
rare injected spikes and NaNs so alarms, interventions and event records happen throughout, and
an in-memory-sized event log (``/dev/null`` by default) attached.

Memory is measured two ways at every report interval: the traced Python heap (``tracemalloc``,
started after a warm-up so one-time allocations do not count) and the process RSS.  Growth of
either beyond ``--max-growth-mb`` between the first and the last report fails the run (exit 1).

Run::

    python benchmarks/bench_soak.py                     # 10M steps (long: prints progress)
    python benchmarks/bench_soak.py --steps 200000 --every 50000

``--no-tracemalloc`` measures step time without tracemalloc's overhead (RSS only).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from stability.monitor.monitor import Monitor
from stability.outputs.events import EventLog

FAMILIES = ("grad_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_kurtosis")
SCALARS = ("loss", "lr", "grad_norm", "param_norm", "tokens_per_s", "mfu", "loss_scale",
           "batch_size", "seq_len", "throughput", "mem_gb", "step_time", "data_time", "z_loss",
           "aux_loss", "moe_balance", "clip_frac", "wd", "epoch", "samples")
BLOCK = 4096  # pre-generated steps, cycled (with a drift) so data generation costs ~nothing


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; falls back to ru_maxrss)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_block(layers: int, seed: int) -> tuple[list[dict[str, float]], np.ndarray]:
    rng = np.random.default_rng(seed)
    scalars = []
    for _ in range(BLOCK):
        v = np.exp(rng.normal(0.0, 0.03, len(SCALARS)))
        d = {k: float(x) for k, x in zip(SCALARS, v, strict=True)}
        d["lr"] = 3e-4
        scalars.append(d)
    fam = np.exp(rng.normal(0.0, 0.03, (BLOCK, len(FAMILIES), layers)))
    fam[:, 2] -= 1.0  # act_mean around 0
    return scalars, np.ascontiguousarray(fam)


def run(steps: int, layers: int, every: int, use_tracemalloc: bool, max_growth_mb: float,
        event_log: str, seed: int = 0) -> int:
    """Run the soak; returns the process exit code (0 = flat memory)."""
    mon = Monitor("llm_pretrain", event_log=EventLog(event_log, fsync="never"))
    names = [f"blk{i}" for i in range(layers)]
    for f in FAMILIES:
        mon.declare_family(f, names)
    scalars, fam = make_block(layers, seed)
    rng = np.random.default_rng(seed + 1)
    spikes = set(rng.integers(10_000, max(steps, 10_001), size=max(1, steps // 200_000)).tolist())
    nans = set(rng.integers(10_000, max(steps, 10_001), size=max(1, steps // 1_000_000)).tolist())
    warm = min(every, 20_000)
    print(f"soak: {steps:,} steps, llm_pretrain, {len(SCALARS)} scalars + "
          f"{len(FAMILIES)} families x {layers} layers, report every {every:,} "
          f"(tracemalloc {'on' if use_tracemalloc else 'off'})", flush=True)
    print(f"{'step':>12} {'us/step':>9} {'heap MiB':>9} {'RSS MiB':>9} {'alarms':>7} "
          f"{'ivs':>6}", flush=True)
    rows: list[tuple[int, float, float, float]] = []
    t_last = time.perf_counter()
    base_heap = 0.0
    obs = mon.observe
    for s in range(steps):
        i = s % BLOCK
        m = scalars[i]
        f = fam[i]
        fams = {"grad_norm": f[0], "update_ratio": f[1], "act_mean": f[2], "act_std": f[3],
                "act_absmax": f[4], "act_kurtosis": f[5]}
        if s in spikes or s in nans or s % 1000 == 0:
            m = dict(m)
            if s % 1000 == 0:
                m["val_loss"] = m["loss"] + 0.1
            if s in spikes:
                m["loss"] *= 30.0
                m["grad_norm"] *= 100.0
            if s in nans:
                m["loss"] = float("nan")
        obs(s, m, families=fams)
        if s + 1 == warm and use_tracemalloc:
            gc.collect()
            tracemalloc.start()
            base_heap = tracemalloc.get_traced_memory()[0] / 2**20
        if (s + 1) % every == 0 or s + 1 == steps:
            now = time.perf_counter()
            n = every if (s + 1) % every == 0 else (s + 1) % every
            us = (now - t_last) / n * 1e6
            heap = (tracemalloc.get_traced_memory()[0] / 2**20 - base_heap
                    if tracemalloc.is_tracing() else float("nan"))
            r = rss_mb()
            rows.append((s + 1, us, heap, r))
            print(f"{s + 1:>12,} {us:>9.2f} {heap:>9.3f} {r:>9.1f} "
                  f"{mon.counters['alarms']:>7} {mon.counters['interventions']:>6}", flush=True)
            t_last = time.perf_counter()
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    if len(rows) < 2:
        print("too few reports to judge memory growth; use a smaller --every")
        return 0
    first, last = rows[0], rows[-1]
    heap_growth = last[2] - first[2] if not np.isnan(first[2]) else 0.0
    rss_growth = last[3] - first[3]
    times = np.array([r[1] for r in rows])
    print(f"\nper-step time: median {np.median(times):.2f} us, min {times.min():.2f}, "
          f"max {times.max():.2f} (max/median {times.max() / np.median(times):.2f})")
    print(f"memory growth first->last report: heap {heap_growth:+.3f} MiB, RSS {rss_growth:+.1f} "
          f"MiB (limit {max_growth_mb} MiB)")
    print(f"alarms {mon.counters['alarms']}, interventions {mon.counters['interventions']}, "
          f"steps {mon.counters['steps']:,}")
    bad = []
    if heap_growth > max_growth_mb:
        bad.append(f"traced heap grew {heap_growth:.2f} MiB")
    if rss_growth > max_growth_mb:
        bad.append(f"RSS grew {rss_growth:.1f} MiB")
    if bad:
        print("FAIL: memory is not flat: " + "; ".join(bad))
        return 1
    print("OK: memory flat")
    return 0


def main(argv: list[str] | None = None) -> int:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady-state figures (cold start: bench_coldstart.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--every", type=int, default=1_000_000, help="report interval (steps)")
    ap.add_argument("--max-growth-mb", type=float, default=4.0)
    ap.add_argument("--no-tracemalloc", action="store_true")
    ap.add_argument("--event-log", default=os.devnull)
    a = ap.parse_args(argv)
    return run(a.steps, a.layers, a.every, not a.no_tracemalloc, a.max_growth_mb, a.event_log)


if __name__ == "__main__":
    raise SystemExit(main())
