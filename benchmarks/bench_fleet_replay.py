"""Replay throughput of a fleet of runs: local processes vs Ray (:mod:`replay.fleet`).

Writes ``--runs`` small synthetic runs (Parquet, ``--steps`` steps of loss / lr / grad_norm; one
in ten with a loss spike) into ``--dir`` (kept between calls), then replays all of them through
the default monitor with ``replay_many`` on each backend, checks that the results are identical
(every summary but the timing) and prints runs/s and steps/s.  Ray is a local instance
(``ray.init(num_cpus=--jobs)``) unless ``--ray-address`` names a cluster.

Run::

    PYTHONPATH=$PWD python benchmarks/bench_fleet_replay.py --runs 2000 --jobs 2
    PYTHONPATH=$PWD python benchmarks/bench_fleet_replay.py --runs 200 --only ray
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.replay import discover_runs, replay_many


def make_runs(out: Path, n: int, steps: int) -> None:
    """``n`` seeded synthetic runs as ``run_XXXXX.parquet`` (existing ones are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        p = out / f"run_{i:05d}.parquet"
        if p.exists():
            continue
        rng = np.random.default_rng(i)
        s = np.arange(steps)
        loss = 3.0 * np.exp(-s / (steps / 3)) + 1.0 + rng.normal(0, 0.02, steps)
        if i % 10 == 0:
            loss[steps // 2:] += 5.0 * np.exp(-(s[steps // 2:] - steps // 2) / 5.0)
        table = pa.table({"step": s.astype(np.int64), "loss": loss,
                          "lr": np.full(steps, 3e-4),
                          "grad_norm": np.exp(rng.normal(0, 0.1, steps))})
        pq.write_table(table, p)


def timed(runs: list[tuple[str, str]], backend: str, jobs: int,
          address: str | None) -> tuple[float, list[dict[str, Any]]]:
    """Seconds of one ``replay_many`` and its summaries without the timings."""
    t0 = time.perf_counter()
    res = replay_many(runs, jobs=jobs if backend == "local" else None, backend=backend,
                      address=address, progress=False)
    dt = time.perf_counter() - t0
    out = []
    for r in res:
        s = r.summary()
        s.pop("seconds")
        out.append(s)
    return dt, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dir", default="/tmp/stability_fleet_runs")
    ap.add_argument("--jobs", type=int, default=2, help="local processes / local Ray CPUs")
    ap.add_argument("--only", choices=("local", "ray"), default=None)
    ap.add_argument("--ray-address", default=None)
    a = ap.parse_args(argv)
    out = Path(a.dir) / f"{a.steps}steps"
    t0 = time.perf_counter()
    make_runs(out, a.runs, a.steps)
    runs = discover_runs(str(out))[: a.runs]
    print(f"{len(runs)} runs x {a.steps} steps in {out} (made in "
          f"{time.perf_counter() - t0:.1f} s)", flush=True)
    results = {}
    for backend in ("local", "ray"):
        if a.only not in (None, backend):
            continue
        if backend == "ray" and a.ray_address is None:
            import ray

            ray.init(num_cpus=a.jobs, include_dashboard=False, log_to_driver=False)
        dt, res = timed(runs, backend, a.jobs, a.ray_address)
        results[backend] = res
        n = sum(r["n_steps"] for r in res)
        print(f"{backend:<6} {dt:7.1f} s  {len(res) / dt:7.1f} runs/s  {n / dt:10,.0f} steps/s  "
              f"({sum(bool(r['alarms']) for r in res)} runs with alarms)", flush=True)
    if len(results) == 2:
        same = results["local"] == results["ray"]
        print(f"results identical: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
