"""RunRecorder under a full disk, and its cost per ``log()`` on a healthy one.

Full disk: every part write fails with ``ENOSPC`` (after serialising the part to memory, which is
what a real write costs before the disk refuses it) for ``--steps`` steps of ``--metrics``
metrics. Prints the worst single ``log()`` call, the RSS growth, the number of write attempts and
the most rows one attempt tried to write. Healthy disk: mean ``log()`` time including part writes.

Run::

    python benchmarks/bench_recorder.py                     # 200k full-disk steps, 40 metrics
    python benchmarks/bench_recorder.py --steps 50000 --max-buffer-mb 16
"""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import replay.recorder as recorder_mod


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def full_disk(steps: int, n_metrics: int, part_steps: int, max_buffer_mb: float) -> None:
    real = pq.write_table
    attempts: list[int] = []

    def write(table: pa.Table, where: Any, **kw: Any) -> None:
        attempts.append(table.num_rows)
        real(table, pa.BufferOutputStream(), compression=kw.get("compression", "zstd"))
        raise OSError(errno.ENOSPC, "No space left on device")

    rec = recorder_mod.RunRecorder(tempfile.mkdtemp(), part_steps=part_steps,
                                   max_buffer_bytes=int(max_buffer_mb * 2**20))
    metrics = {f"grad_norm/blk{i}": 0.1 * i for i in range(n_metrics)}
    recorder_mod.pq.write_table = write
    try:
        gc.collect()
        rss0, worst = _rss_mib(), 0.0
        t0 = time.perf_counter()
        for s in range(steps):
            a = time.perf_counter()
            rec.log(s, metrics)
            worst = max(worst, time.perf_counter() - a)
        total = time.perf_counter() - t0
        print(f"full disk, {steps} steps x {n_metrics} metrics (part_steps={part_steps}, "
              f"max_buffer_bytes={max_buffer_mb:g} MiB): worst log() {worst * 1e3:.1f} ms, "
              f"mean {total / steps * 1e6:.1f} us, RSS +{_rss_mib() - rss0:.0f} MiB, "
              f"queued {rec.buffered_bytes / 2**20:.1f} MiB, rows dropped {rec.rows_dropped}, "
              f"{len(attempts)} write attempts of at most {max(attempts, default=0)} rows")
        try:
            rec.close()
        except OSError as exc:
            print(f"close(): {exc}")
    finally:
        recorder_mod.pq.write_table = real


def healthy(steps: int, n_metrics: int, part_steps: int) -> None:
    metrics = {f"grad_norm/blk{i}": 0.1 * i for i in range(n_metrics)}
    rec = recorder_mod.RunRecorder(tempfile.mkdtemp(), part_steps=part_steps)
    t0 = time.perf_counter()
    for s in range(steps):
        rec.log(s, metrics)
    dt = (time.perf_counter() - t0) / steps * 1e6
    rec.close()
    print(f"healthy disk, {steps} steps x {n_metrics} metrics: {dt:.1f} us per log() "
          "(part writes included)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--metrics", type=int, default=40)
    ap.add_argument("--part-steps", type=int, default=1000)
    ap.add_argument("--max-buffer-mb", type=float, default=64.0)
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)  # the recorder's once-per-outage warnings
    healthy(min(args.steps, 20_000), args.metrics, args.part_steps)
    full_disk(args.steps, args.metrics, args.part_steps, args.max_buffer_mb)


if __name__ == "__main__":
    main()
