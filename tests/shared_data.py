"""Where the tests find run data: the runs the project ships, and the workplace's shared runs.

Shipped with the repository (always present, so tests on them never skip):

* ``SAMPLE_RUNS`` / ``SAMPLE_LABELS``: ``data/runs`` (seven recorder runs of tiny models, one
  directory of Parquet parts each) and their labels (``data/README.md``);
* ``BENCH_RUNS`` / ``BENCH_LABELS``: ``benchmarks/data/bench14`` (304 labelled 240-step runs,
  one Parquet file each; ``benchmarks/make_benchmark.py``).

The shared, labelled public runs live in ``../shared`` beside the checkout; set
``STABILITY_SHARED_DIR`` to point elsewhere (when set, it is the only place looked at). Tests
that need them call :func:`need_shared` (or skip with a reason of their own) so the test command
passes on a fresh clone alone.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]

SAMPLE_RUNS = _REPO / "data" / "runs"
SAMPLE_LABELS = _REPO / "data" / "labels.parquet"
BENCH_RUNS = _REPO / "benchmarks" / "data" / "bench14" / "runs"
BENCH_LABELS = _REPO / "benchmarks" / "data" / "bench14" / "labels.parquet"


def _locate() -> Path:
    env = os.environ.get("STABILITY_SHARED_DIR")
    if env:
        return Path(env)
    return _REPO.parent / "shared"


SHARED = _locate()
PUBLIC = SHARED / "runs" / "public"
PUBLIC_RUNS = PUBLIC / "runs"
PUBLIC_LABELS = PUBLIC / "labels.parquet"


def need_shared(path: Path) -> Path:
    """``path`` if it exists; otherwise skip the calling test with a reason naming it."""
    import pytest

    if not path.exists():
        pytest.skip(f"shared data not found: {path} (set STABILITY_SHARED_DIR to the workplace's "
                    "shared/ folder to run this test)")
    return path
