"""Replay / tuning throughput figures (prints; no assertions).

* points/s from Parquet to alarms: a synthetic wide run (``--rows`` x ``--cols``) is written in
  row groups to a temp dir, then streamed back with :func:`replay.reader.iter_batches` through
  two cheap detectors per column (linear ``EWMAZScore`` + ``NonFiniteGuard``), single process;
* peak memory of that streaming replay (``tracemalloc`` peak of Python allocations and
  ``ru_maxrss``); ``--full`` uses 100M rows;
* the tuning sweep: ``--sweep-thresholds`` thresholds over ``--sweep-steps`` recorded steps
  (profiles + :func:`replay.scoring.sweep`), after the scores are computed once.

Usage::

    python benchmarks/bench_replay.py                 # 10M rows x 4 columns
    python benchmarks/bench_replay.py --full          # 100M rows
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_run(path: str, rows: int, cols: int, chunk: int = 1_000_000) -> None:
    rng = np.random.default_rng(0)
    schema = pa.schema([("step", pa.int64())] + [(f"m{i}", pa.float64()) for i in range(cols)])
    with pq.ParquetWriter(path, schema, compression="snappy") as w:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            arrays = [pa.array(np.arange(start, start + n, dtype=np.int64))]
            for _ in range(cols):
                arrays.append(pa.array(np.exp(rng.normal(0.0, 0.05, n))))
            w.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=n)


def bench_replay(path: str, cols: int, batch_rows: int) -> tuple[float, int, float]:
    from detectors import EWMAZScore, NonFiniteGuard
    from replay.reader import iter_batches

    ew = EWMAZScore(n_series=cols, log_space=False)
    nf = NonFiniteGuard(n_series=cols)
    # warm the JIT
    ew.update_many(np.ones((2, cols)))
    nf.update_many(np.ones((2, cols)))
    ew.reset()
    nf.reset()
    names = [f"m{i}" for i in range(cols)]
    tracemalloc.start()
    t0 = time.perf_counter()
    rows = 0
    n_alarms = 0
    for b in iter_batches(path, batch_rows=batch_rows):
        x = np.empty((b.num_rows, cols))
        miss = np.empty((b.num_rows, cols), dtype=np.bool_)
        for j, name in enumerate(names):
            col = b.column(b.schema.get_field_index(name))
            x[:, j] = col.to_numpy(zero_copy_only=False)
            miss[:, j] = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else False
        _, a1 = ew.update_many(x, missing=miss)
        _, a2 = nf.update_many(x, missing=miss)
        n_alarms += int(a1.sum() + a2.sum())
        rows += b.num_rows
    el = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return rows * cols / el, n_alarms, peak / 2**20


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--cols", type=int, default=4)
    ap.add_argument("--full", action="store_true", help="100M rows")
    ap.add_argument("--batch-rows", type=int, default=1 << 20)
    ap.add_argument("--sweep-steps", type=int, default=10_000_000)
    ap.add_argument("--sweep-thresholds", type=int, default=1000)
    ap.add_argument("--sweep-run-len", type=int, default=10_000)
    a = ap.parse_args()
    rows = 100_000_000 if a.full else a.rows
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.parquet")
        t0 = time.perf_counter()
        write_run(path, rows, a.cols)
        size = os.path.getsize(path) / 2**20
        print(f"wrote {rows:,} rows x {a.cols} cols ({size:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f}s")
        pps, n_alarms, peak = bench_replay(path, a.cols, a.batch_rows)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"replay Parquet -> alarms (EWMAZScore + NonFiniteGuard per column, 1 core): "
              f"{pps / 1e6:.1f}M points/s, {n_alarms} alarms")
        print(f"peak memory: tracemalloc {peak:.0f} MiB, max RSS {rss:.0f} MiB")
    sw = bench_sweep(a.sweep_steps, a.sweep_thresholds, a.sweep_run_len)
    print(f"tuning sweep: {a.sweep_thresholds} thresholds over {a.sweep_steps:,} steps "
          f"({sw['runs']} runs): profiles {sw['profiles_s']:.2f}s + sweep {sw['sweep_s']:.2f}s "
          f"= {sw['total_s']:.2f}s")


if __name__ == "__main__":
    main()
