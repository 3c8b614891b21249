"""Replay / tuning throughput figures (prints; no assertions).

**Points** are the non-null metric values a replay feeds to the detectors: the values of the
columns the config binds, each counted once however many detectors read it (nulls -- steps on
which a metric was not logged -- are not points).  Figures are per core: one process, pyarrow
limited to one thread, the Numba kernels are single-threaded; points per CPU second of the
process (``time.process_time``: on a shared, oversubscribed box wall time counts the other
processes too; it is printed beside), the best of ``--repeat`` runs.  Target (issue 17): 40M
points/s/core.

* ``narrow``: the issue's benchmark, a synthetic ``--rows`` x ``--cols`` run (``m0..``) through
  a monitor with two cheap detectors per column (``nonfinite`` on ``*`` and a linear
  ``ewma_z`` on ``m*``): ``Monitor.replay`` of the in-memory Arrow table (no read) and
  ``replay.replay.replay_run`` of the Parquet file (read + replay + summary);
* ``wide``: a synthetic training run shaped like the recorder's (loss, lr, grad / param norms,
  per-layer grad norms, update ratios and activation statistics, val_loss every 100 steps;
  ``--wide-rows`` rows, 44 columns) through the ``default`` preset (17 detector banks);
* ``samples``: the bundled sample runs (``data/runs/*``) through the ``default`` preset;
* the tuning sweep: ``--sweep-thresholds`` thresholds over ``--sweep-steps`` recorded steps
  (profiles + :func:`replay.scoring.sweep`), after the scores are computed once.

Usage::

    python benchmarks/bench_replay.py                 # 10M rows x 4 columns, 1M wide rows
    python benchmarks/bench_replay.py --rows 2000000 --wide-rows 200000 --repeat 1  # quick
    python benchmarks/bench_replay.py --banks   # + CPU time of each bank in the wide replay
    python benchmarks/bench_replay.py --rss-rows 10000000  # + peak RSS of a 10M-row replay_run
    python benchmarks/bench_replay.py --rss-rows 1000000 --rss-whole  # streamed vs read whole
    python benchmarks/bench_replay.py --rss-rows 100000000 --rss-narrow  # 100M rows x 4
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

TARGET = 40e6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NARROW = {"detectors": [
    {"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"], "kind": "nonfinite"},
    {"name": "z", "detector": "ewma_z", "inputs": ["m*"], "params": {"log_space": False}},
]}


def write_run(path: str, rows: int, cols: int, chunk: int = 1_000_000) -> None:
    """The narrow run: ``step`` + ``cols`` log-normal columns, in 1M-row groups."""
    rng = np.random.default_rng(0)
    schema = pa.schema([("step", pa.int64())] + [(f"m{i}", pa.float64()) for i in range(cols)])
    with pq.ParquetWriter(path, schema, compression="snappy") as w:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            arrays = [pa.array(np.arange(start, start + n, dtype=np.int64))]
            for _ in range(cols):
                arrays.append(pa.array(np.exp(rng.normal(0.0, 0.05, n))))
            w.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=n)


def wide_table(rows: int, layers: int = 8, eval_every: int = 100) -> pa.Table:
    """A healthy training run with the recorder's metric names (44 columns)."""
    rng = np.random.default_rng(1)
    t = np.arange(rows)
    cols: dict[str, Any] = {"step": t.astype(np.int64)}
    cols["loss"] = 2.0 + 1.0 / np.sqrt(1 + t / 100) + 0.02 * rng.standard_normal(rows)
    cols["lr"] = np.full(rows, 1e-3)
    cols["grad_norm"] = np.exp(rng.normal(0.0, 0.1, rows))
    cols["param_norm"] = 100.0 + 1e-4 * t
    for k in range(layers):
        cols[f"grad_norm/{k}"] = np.exp(rng.normal(0.0, 0.1, rows))
        cols[f"update_ratio/{k}"] = np.exp(rng.normal(-7.0, 0.1, rows))
        cols[f"act_mean/{k}"] = rng.normal(0.0, 0.1, rows)
        cols[f"act_std/{k}"] = np.exp(rng.normal(0.0, 0.05, rows))
        cols[f"act_absmax/{k}"] = np.exp(rng.normal(1.0, 0.05, rows))
    arrays = {k: pa.array(v) for k, v in cols.items()}
    arrays["val_loss"] = pa.array(2.1 + 1.0 / np.sqrt(1 + t / 100),
                                  mask=(t % eval_every) != eval_every - 1)
    return pa.table(arrays)


def points(table: pa.Table, config: Any) -> int:
    """Non-null values of the columns a monitor built from ``config`` binds."""
    from stability.monitor.monitor import Monitor

    names = [n for n in table.column_names if n != "step"]
    bound = Monitor(config, alert_sinks=[]).bound_names(names)
    return sum(len(table.column(n)) - table.column(n).null_count for n in bound)


def best(fn: Callable[[], Any], repeat: int) -> tuple[tuple[float, float], Any]:
    """``((cpu seconds, wall seconds), result)`` of the run with the least CPU time."""
    out, el = None, (float("inf"), float("inf"))
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        el = min(el, (time.process_time() - c0, time.perf_counter() - t0))
    return el, out


def line(label: str, pts: int, seconds: tuple[float, float], extra: str = "") -> None:
    cpu, wall = seconds
    rate = pts / cpu
    print(f"  {label:<38} {rate / 1e6:6.1f}M points/s/core ({rate / TARGET:4.0%} of the 40M "
          f"target; {pts:,} points in {cpu:.3f} CPU-s, {wall:.3f} s wall){extra}")


def replay_memory(table: pa.Table, config: Any) -> int:
    from stability.monitor.monitor import Monitor

    return len(Monitor(config, alert_sinks=[]).replay(table).events())


def replay_file(path: str, config: Any) -> int:
    from replay.replay import replay_run

    return len(replay_run(path, config).alarms)


def kernel_share(table: pa.Table, config: Any) -> float:
    """CPU seconds spent inside the detector banks' batch kernels during one replay."""
    from detectors._base import BankDetector

    orig = BankDetector.update_many_array
    spent = [0.0]

    def timed(self: Any, *args: Any) -> None:
        c0 = time.process_time()
        orig(self, *args)
        spent[0] += time.process_time() - c0

    BankDetector.update_many_array = timed  # type: ignore[method-assign]
    try:
        replay_memory(table, config)
    finally:
        BankDetector.update_many_array = orig  # type: ignore[method-assign]
    return spent[0]


def bank_times(table: pa.Table, config: Any) -> None:
    """Print the CPU time of each bank's batch kernel during one replay (largest first), the
    input fill, the non-finite guard's finite chunks and the per-step tail."""
    import stability.monitor.monitor as mr
    from detectors._base import BankDetector
    from detectors.nonfinite import NonFiniteGuard
    from stability.monitor.replay_fill import Block

    spent: dict[str, float] = {}

    def timed(label: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            c0 = time.process_time()
            out = fn(*args, **kw)
            key = label(*args)
            spent[key] = spent.get(key, 0.0) + time.process_time() - c0
            return out
        return run

    patches = [
        (BankDetector, "update_many_array", timed(
            lambda self, x, *a: f"{type(self).__name__} {x.shape[1]}x{x.shape[2]}",
            BankDetector.update_many_array)),
        (NonFiniteGuard, "update_finite_many", timed(
            lambda *a: "NonFiniteGuard, finite chunks", NonFiniteGuard.update_finite_many)),
        (Block, "fill", timed(lambda *a: "input fill", Block.fill)),
        (mr.Replay, "_tail", timed(lambda *a: "per-step tail", mr.Replay._tail)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        c0 = time.process_time()
        replay_memory(table, config)
        total = time.process_time() - c0
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    print(f"  CPU ms per part of one replay ({total * 1e3:.0f} ms in all):")
    for key, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"    {key:<36} {sec * 1e3:8.1f}")


def bench_case(name: str, path: str, config: Any, repeat: int, banks: bool = False) -> None:
    from replay.reader import read_run

    table = read_run(path)
    pts = points(table, config)
    replay_memory(table.slice(0, 2000), config)  # warm the JIT and the imports
    el, n_ev = best(lambda: replay_memory(table, config), repeat)
    k = kernel_share(table, config)
    line(f"{name}: Monitor.replay (in memory)", pts, el,
         f", {n_ev} steps with events; detector kernels {k:.3f} CPU-s "
         f"({pts / k / 1e6:.0f}M points/s alone)")
    el, n_al = best(lambda: replay_file(path, config), repeat)
    line(f"{name}: replay_run (Parquet -> alarms)", pts, el, f", {n_al} alarms")
    if banks:
        bank_times(table, config)


def bench_samples(repeat: int) -> None:
    from replay.reader import read_run

    runs = sorted(glob.glob(os.path.join(ROOT, "data", "runs", "*")))
    if not runs:
        print("  (no sample runs under data/runs)")
        return
    tables = [read_run(r) for r in runs]
    pts = sum(points(t, "default") for t in tables)
    replay_memory(tables[0], "default")
    el, _ = best(lambda: [replay_memory(t, "default") for t in tables], repeat)
    line(f"{len(runs)} sample runs: Monitor.replay", pts, el,
         f", {sum(t.num_rows for t in tables):,} steps")
    el, _ = best(lambda: [replay_file(r, "default") for r in runs], repeat)
    line(f"{len(runs)} sample runs: replay_run", pts, el)


_RSS_CHILD = r"""
import json, resource, sys, time
import pyarrow as pa
import pyarrow.parquet as pq
pa.set_cpu_count(1)
pa.set_io_thread_count(1)
from detectors import dispatch
dispatch.set_mode("blocking")
import replay.replay as rr
from stability.monitor.monitor import Monitor
def hwm():  # peak RSS of this process image (ru_maxrss survives exec on Linux)
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
path = sys.argv[1]
if sys.argv[2] == "whole":  # the stream off: read whole, as before the stream
    rr.plan_replay = lambda p, c: (None, None)
cfg = json.loads(sys.argv[3])
Monitor(cfg, alert_sinks=[]).replay(next(pq.ParquetFile(path).iter_batches(2000)))
before = hwm()
c0 = time.process_time()
res = rr.replay_run(path, cfg)
cpu = time.process_time() - c0
peak = hwm()
print(f"{res.n_steps} {cpu:.3f} {before:.0f} {peak:.0f}")
"""


def bench_rss(rows: int, d: str, whole: bool = False, narrow: bool = False) -> None:
    """``replay_run`` of a ``rows``-row run in a fresh process: CPU time and peak RSS, before
    and after (the warmed-up interpreter); ``whole``: again with the stream off (the run read
    whole).  The wide run (the 1M-row one repeated) through the default preset, or
    (``narrow``) the narrow run through its config, in 1M-row groups."""
    import json
    import subprocess
    import sys

    path = os.path.join(d, "big.parquet")
    if narrow:
        write_run(path, rows, 4)
        cfg: Any = NARROW
        pts, shape = 4 * rows, "4"
    else:
        cfg = "default"
        base = wide_table(min(rows, 1_000_000))
        with pq.ParquetWriter(path, base.schema, compression="snappy") as w:
            for lo in range(0, rows, base.num_rows):
                n = min(base.num_rows, rows - lo)
                t = base.slice(0, n).set_column(0, "step", pa.array(np.arange(lo, lo + n)))
                w.write_table(t, row_group_size=1 << 20)
        pts, shape = points(base, cfg) * rows // base.num_rows, "44"  # the blocks repeat
    env = {**os.environ, "PYTHONPATH": ROOT}
    for mode in ("stream", "whole") if whole else ("stream",):
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path, mode, json.dumps(cfg)],
                             env=env, check=True, capture_output=True, text=True).stdout.split()
        n, cpu, before, peak = int(out[0]), float(out[1]), float(out[2]), float(out[3])
        how = "streamed" if mode == "stream" else "read whole"
        print(f"  replay_run of {n:,} rows x {shape} columns, {how}, in a fresh process: "
              f"{pts / cpu / 1e6:.1f}M points/s/core ({cpu:.2f} CPU-s); peak RSS {peak:.0f} MiB "
              f"(+{peak - before:.0f} MiB over the warmed-up interpreter's {before:.0f})")
    os.remove(path)


def bench_sweep(steps: int, thresholds: int, run_len: int) -> dict[str, float]:
    from replay.labels import RunLabel
    from replay.scoring import run_profile, summarise_sweep, sweep

    rng = np.random.default_rng(1)
    n_runs = steps // run_len
    st = np.arange(run_len)
    t0 = time.perf_counter()
    profiles = []
    for r in range(n_runs):
        s = rng.standard_normal(run_len)
        lab = RunLabel(f"r{r}") if r % 3 == 0 else RunLabel(
            f"r{r}", "x", int(run_len // 2), None, "diverged", nan_step=int(run_len // 2 + 100))
        profiles.append(run_profile(st, s, lab))
    t1 = time.perf_counter()
    th = np.linspace(0.0, 6.0, thresholds)
    sm = summarise_sweep(sweep(profiles, th))
    t2 = time.perf_counter()
    assert sm.recall.size == thresholds
    return {"profiles_s": t1 - t0, "sweep_s": t2 - t1, "total_s": t2 - t0, "runs": n_runs}


def main() -> None:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady-state figures (cold start: bench_coldstart.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000, help="narrow run rows")
    ap.add_argument("--cols", type=int, default=4, help="narrow run columns")
    ap.add_argument("--wide-rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sweep-steps", type=int, default=10_000_000)
    ap.add_argument("--sweep-thresholds", type=int, default=1000)
    ap.add_argument("--sweep-run-len", type=int, default=10_000)
    ap.add_argument("--rss-rows", type=int, default=0,
                    help="also replay_run a wide run of this many rows in a fresh process and "
                         "print its peak RSS")
    ap.add_argument("--rss-whole", action="store_true",
                    help="with --rss-rows: also with the stream off (the run read whole)")
    ap.add_argument("--rss-narrow", action="store_true",
                    help="with --rss-rows: the narrow run (4 columns) instead of the wide one")
    ap.add_argument("--banks", action="store_true",
                    help="also print the CPU time of each bank kernel during one wide replay")
    a = ap.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; best of {a.repeat}")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "narrow.parquet")
        write_run(path, a.rows, a.cols)
        print(f"narrow: {a.rows:,} rows x {a.cols} columns, nonfinite + linear ewma_z per column")
        bench_case("narrow", path, NARROW, a.repeat)
        wpath = os.path.join(d, "wide.parquet")
        pq.write_table(wide_table(a.wide_rows), wpath, row_group_size=1 << 20)
        print(f"wide: {a.wide_rows:,} rows x 44 columns, default preset")
        bench_case("wide", wpath, "default", a.repeat, a.banks)
        if a.rss_rows:
            bench_rss(a.rss_rows, d, a.rss_whole, a.rss_narrow)
    print("samples: data/runs/*, default preset")
    bench_samples(a.repeat)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"max RSS {rss:.0f} MiB")
    sw = bench_sweep(a.sweep_steps, a.sweep_thresholds, a.sweep_run_len)
    print(f"tuning sweep: {a.sweep_thresholds} thresholds over {a.sweep_steps:,} steps "
          f"({sw['runs']} runs): profiles {sw['profiles_s']:.2f}s + sweep {sw['sweep_s']:.2f}s "
          f"= {sw['total_s']:.2f}s")


if __name__ == "__main__":
    main()
