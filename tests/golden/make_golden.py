"""Regenerate the golden replays: what the monitor decides on a fixed set of recorded runs.

The golden files pin behaviour across refactors (issues 13 and 25): the same runs must replay to
the same alarms and interventions.  Two sets:

* ``shipped_replay.json.gz``: the runs the repository ships (``data/runs`` and
  ``benchmarks/data/bench14/runs``), so the pin runs on a fresh clone and in CI;
* ``public_replay.json.gz``: the workplace's shared public runs (``../shared``), checked when they
  are present.

Regenerate them only for an intended behaviour change, and say so in the commit message::

    python tests/golden/make_golden.py                     # shipped
    STABILITY_SHARED_DIR=../shared python tests/golden/make_golden.py --set public
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.shared_data import BENCH_RUNS, PUBLIC_RUNS, SAMPLE_RUNS  # noqa: E402

PRESETS = ("default", "llm_pretrain")
HERE = Path(__file__).parent
GOLDEN = {"shipped": HERE / "shipped_replay.json.gz", "public": HERE / "public_replay.json.gz"}


def shipped_runs() -> list[Path]:
    """The sample runs (directories of parts) and the benchmark runs (one file each)."""
    samples = sorted(p for p in SAMPLE_RUNS.iterdir() if p.is_dir())
    return samples + sorted(BENCH_RUNS.glob("*.parquet"))


def public_runs() -> list[Path]:
    """The shared public runs; empty when they are absent."""
    return sorted(PUBLIC_RUNS.glob("*.parquet")) if PUBLIC_RUNS.exists() else []


RUNS = {"shipped": shipped_runs, "public": public_runs}


def run_name(path: Path) -> str:
    """The key of a run in a golden file: its directory name or file stem."""
    return path.name if path.is_dir() else path.stem


def decisions(path: Path, preset: str) -> dict[str, Any]:
    """Alarms and interventions of one replay, in a canonical, JSON-stable form."""
    from replay.replay import replay_run

    res = replay_run(path, preset)
    alarms = sorted((int(a.step), a.detector, a.signal, a.kind, round(float(a.score), 6))
                    for a in res.alarms)
    ivs = [(int(i.step), i.type, getattr(i, "cause", "")) for i in res.interventions]
    return {"alarms": [list(a) for a in alarms], "interventions": [list(i) for i in ivs]}


def compute(which: str) -> dict[str, Any]:
    """``{"<preset>/<run>": decisions}`` for every run of the set ``which``."""
    runs = RUNS[which]()
    if not runs:
        raise SystemExit(f"no runs for the {which!r} set (shared data: set STABILITY_SHARED_DIR)")
    return {f"{preset}/{run_name(p)}": decisions(p, preset) for preset in PRESETS for p in runs}


def load(which: str) -> dict[str, Any]:
    """The committed golden decisions of the set ``which``."""
    return json.loads(gzip.decompress(GOLDEN[which].read_bytes()))


def write(which: str) -> None:
    """Recompute and write the golden file of the set ``which``."""
    data = compute(which)
    text = json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n"
    GOLDEN[which].write_bytes(gzip.compress(text.encode(), mtime=0))
    n_a = sum(len(v["alarms"]) for v in data.values())
    n_i = sum(len(v["interventions"]) for v in data.values())
    print(f"wrote {GOLDEN[which]}: {len(data)} replays, {n_a} alarms, {n_i} interventions")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=[*RUNS, "all"], default="shipped")
    for name in (list(RUNS) if ap.parse_args().set == "all" else [ap.parse_args().set]):
        write(name)
