"""Regenerate ``public_replay.json.gz``: what the monitor decides on every shared public run.

The golden file pins behaviour across refactors (issue 13): the same runs must replay to the
same alarms and interventions.  Regenerate it only for an intended behaviour change, and say so
in the commit message::

    STABILITY_SHARED_DIR=../shared python tests/golden/make_golden.py
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.shared_data import PUBLIC_RUNS  # noqa: E402

PRESETS = ("default", "llm_pretrain")
GOLDEN = Path(__file__).with_name("public_replay.json.gz")


def decisions(path: Path, preset: str) -> dict[str, Any]:
    """Alarms and interventions of one replay, in a canonical, JSON-stable form."""
    from replay.replay import replay_run

    res = replay_run(path, preset)
    alarms = sorted((int(a.step), a.detector, a.signal, a.kind, round(float(a.score), 6))
                    for a in res.alarms)
    ivs = [(int(i.step), i.type, getattr(i, "cause", "")) for i in res.interventions]
    return {"alarms": [list(a) for a in alarms], "interventions": [list(i) for i in ivs]}


def compute() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for preset in PRESETS:
        for p in sorted(PUBLIC_RUNS.glob("*.parquet")):
            out[f"{preset}/{p.stem}"] = decisions(p, preset)
    return out


if __name__ == "__main__":
    data = compute()
    text = json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n"
    GOLDEN.write_bytes(gzip.compress(text.encode(), mtime=0))
    n_a = sum(len(v["alarms"]) for v in data.values())
    n_i = sum(len(v["interventions"]) for v in data.values())
    print(f"wrote {GOLDEN}: {len(data)} replays, {n_a} alarms, {n_i} interventions")
