"""Behaviour pin: recorded runs replay to the committed alarms and interventions.

The golden files were written by ``tests/golden/make_golden.py``; refactors must not change a
single decision.  An intended behaviour change regenerates them (see that script) and says so in
the commit message.

* The **shipped** set (``data/runs`` + ``benchmarks/data/bench14``) is part of the repository:
  it never skips; a missing run is a failure.
* The **public** set needs the workplace's shared runs: without them it skips with a reason, except
  under CI (``CI=true``), where a golden test that cannot run is a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.golden.make_golden import PRESETS, RUNS, decisions, load, run_name
from tests.shared_data import PUBLIC_RUNS

SETS = ("shipped", "public")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _runs(which: str) -> list[Path]:
    runs = RUNS[which]()
    if runs:
        return runs
    reason = f"no runs for the golden {which!r} set"
    if which == "shipped" or _in_ci():
        pytest.fail(f"{reason}: the behaviour pin must run here "
                    f"(shared runs: set STABILITY_SHARED_DIR, looked in {PUBLIC_RUNS})")
    pytest.skip(f"{reason}: shared public runs not found at {PUBLIC_RUNS} "
                "(set STABILITY_SHARED_DIR); the shipped set still runs")


def _first_difference(name: str, part: str, want: list[Any], got: list[Any]) -> str:
    n = min(len(want), len(got))
    i = next((i for i in range(n) if want[i] != got[i]), n)
    return (f"{name} {part} differ at #{i}: golden {want[i] if i < len(want) else None} vs now "
            f"{got[i] if i < len(got) else None} ({len(want)} golden, {len(got)} now)")


@pytest.mark.parametrize("which", SETS)
@pytest.mark.parametrize("preset", PRESETS)
def test_runs_replay_to_the_golden_decisions(which: str, preset: str) -> None:
    runs = _runs(which)
    golden = load(which)
    assert {k for k in golden if k.startswith(preset + "/")} == {
        f"{preset}/{run_name(p)}" for p in runs}, "the set of runs changed: regenerate on purpose"
    for p in runs:
        name = f"{preset}/{run_name(p)}"
        want, got = golden[name], json.loads(json.dumps(decisions(p, preset)))
        for part in ("alarms", "interventions"):
            if want[part] != got[part]:
                pytest.fail(_first_difference(name, part, want[part], got[part]))


def test_the_shipped_set_covers_faults_and_clean_runs() -> None:
    golden = load("shipped")
    runs = {k.split("/", 1)[1] for k in golden}
    assert {"clean", "lr_blowup", "bitflip", "grad_explosion"} <= runs and len(runs) >= 300
    alarmed = sum(bool(v["alarms"]) for v in golden.values())
    quiet = sum(not v["alarms"] for v in golden.values())
    assert alarmed > 100 and quiet > 50, "a pin without alarms (or without quiet runs) pins little"
