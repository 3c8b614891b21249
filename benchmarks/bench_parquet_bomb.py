"""Peak memory of replaying a Parquet decompression bomb: a small file of millions of repeated
rows (one step, written with zstd), replayed by ``stability replay`` in a child process.

The reader merges duplicate steps batch by batch (``replay.reader.MERGE_ROWS``), so the peak
follows the run's distinct steps, not the row count.

    python benchmarks/bench_parquet_bomb.py --rows 20000000
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def write_bomb(path: Path, rows: int, chunk: int = 1 << 22) -> None:
    """``rows`` rows of step 0 (loss 1.0), written in row groups of ``chunk`` rows."""
    schema = pa.schema([("step", pa.int64()), ("loss", pa.float64())])
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        left = rows
        while left:
            n = min(chunk, left)
            w.write_table(pa.table({"step": np.zeros(n, np.int64), "loss": np.ones(n)},
                                   schema=schema))
            left -= n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "bomb.parquet"
        write_bomb(p, args.rows)
        size = p.stat().st_size
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "replay.cli", "replay", str(p)],
                            capture_output=True, text=True, env={**os.environ}).returncode
        wall = time.perf_counter() - t0
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    raw_mib = args.rows * 16 / 2**20
    print("| rows | file | rows x 16 B | replay rc | peak RSS of the replay | wall |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.rows:,} | {size / 2**20:.2f} MiB | {raw_mib:,.0f} MiB | {rc} | "
          f"{peak_kib / 1024:,.0f} MiB | {wall:.1f} s |")


if __name__ == "__main__":
    main()
