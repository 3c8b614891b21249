"""The issue-14 signature bindings of the presets on the committed bench14 runs.

``grad_vanishing``, ``overfit_gap`` and ``loss_level_persistent`` must catch their faults after
the onset and never alarm on the clean runs (or before any onset).  The runs are recorded by
``benchmarks/make_benchmark.py`` (real tinytrain training); the test only replays them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stability.monitor.monitor import Monitor

pq = pytest.importorskip("pyarrow.parquet")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "bench14"
NEW = ("grad_vanishing", "overfit_gap", "loss_level_persistent")

pytestmark = pytest.mark.skipif(not (BENCH / "labels.parquet").exists(),
                                reason="benchmarks/data/bench14 absent")


def _labels() -> list[dict]:
    return pq.read_table(BENCH / "labels.parquet").to_pylist()


def _alarms(run_id: str, preset: str) -> list[tuple[int, str]]:
    table = pq.read_table(BENCH / "runs" / f"{run_id}.parquet")
    mon = Monitor(preset, alert_sinks=[], handler_timeout=None)
    return [(d.step, a.detector) for d in mon.replay(table) for a in d.alarms]


def _pick(scenario: str, n: int, **extra: object) -> list[dict]:
    rows = [r for r in _labels() if r["scenario"] == scenario
            and all(r.get(k) == v for k, v in extra.items())]
    return rows[:n]


@pytest.mark.parametrize("preset", ["default", "llm_pretrain"])
def test_new_bindings_stay_quiet_on_clean_runs_and_before_onsets(preset: str) -> None:
    rows = _pick("clean", 12) + _pick("input_shift", 4) + _pick("overfit", 4)
    for r in rows:
        onset = r["onset_step"] if r["onset_step"] is not None else 10**9
        early = [(s, d) for s, d in _alarms(r["run_id"], preset) if d in NEW and s < onset]
        assert early == [], (r["run_id"], early)


def test_gradient_underflow_alarms_grad_vanishing() -> None:
    for r in _pick("fp16_underflow", 6):
        hits = [s for s, d in _alarms(r["run_id"], "default") if d == "grad_vanishing"]
        assert hits and r["onset_step"] <= hits[0] <= r["onset_step"] + 2, (r["run_id"], hits)


def test_memorisation_alarms_overfit_gap_within_four_validation_points() -> None:
    rows = _pick("overfit", 3, severity="severe", persistence="persistent")
    assert rows
    for r in rows:
        hits = [s for s, d in _alarms(r["run_id"], "default") if d == "overfit_gap"]
        # validation every 20 steps: the 4th validation point after the onset at the latest
        assert hits and r["onset_step"] < hits[0] <= r["onset_step"] + 4 * 20, (r["run_id"], hits)


def test_persistent_input_shift_alarms_level_shift() -> None:
    rows = _pick("input_shift", 17, persistence="persistent")
    caught = 0
    for r in rows:
        hits = [s for s, d in _alarms(r["run_id"], "default") if d == "loss_level_persistent"]
        caught += bool(hits and hits[0] >= r["onset_step"])
    assert caught >= len(rows) // 2, (caught, len(rows))
