"""Behaviour pin: every shared public run replays to the committed alarms and interventions.

The golden file was written by ``tests/golden/make_golden.py`` before the architecture
consolidation (issue 13); refactors must not change a single decision.  An intended behaviour
change regenerates it (see that script) and says so in the commit message.
"""

from __future__ import annotations

import gzip
import json

import pytest

from tests.golden.make_golden import GOLDEN, PRESETS, decisions
from tests.shared_data import PUBLIC_RUNS

RUNS = sorted(PUBLIC_RUNS.glob("*.parquet")) if PUBLIC_RUNS.exists() else []
pytestmark = pytest.mark.skipif(not RUNS, reason="shared public runs not found")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(gzip.decompress(GOLDEN.read_bytes()))


@pytest.mark.parametrize("preset", PRESETS)
def test_public_runs_replay_to_the_golden_decisions(golden: dict, preset: str) -> None:
    assert {k for k in golden if k.startswith(preset + "/")} == {f"{preset}/{p.stem}" for p in RUNS}
    for p in RUNS:
        want = golden[f"{preset}/{p.stem}"]
        got = json.loads(json.dumps(decisions(p, preset)))
        for part in ("alarms", "interventions"):
            w, g = want[part], got[part]
            if w != g:
                n = min(len(w), len(g))
                i = next((i for i in range(n) if w[i] != g[i]), n)
                pytest.fail(f"{preset}/{p.stem} {part} differ at #{i}: golden "
                            f"{w[i] if i < len(w) else None} vs now {g[i] if i < len(g) else None}"
                            f" ({len(w)} golden, {len(g)} now)")
