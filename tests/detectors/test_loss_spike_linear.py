"""The presets' ``loss_spike_linear`` binding: a loss spike score that does not go blind near the
loss floor.

A loss near its floor has a huge spread in log space (a batch without a hard example scores
~0), so the log-space bindings (``loss_spike``, ``loss_spike_robust``) see even a x1000 jump as
a few sigma.  ``loss_spike_linear`` scores the loss in linear space, where that noise is bounded
by the level itself.  It must catch such a jump and stay quiet on healthy runs: the committed
clean runs (bench14, long clean, SGD-small) and the steps before every bench14 fault onset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stability.monitor.monitor import Monitor

pq = pytest.importorskip("pyarrow.parquet")

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
BENCH = DATA / "bench14"
NAME = "loss_spike_linear"


def floor_noise(n: int, seed: int) -> np.ndarray:
    """A loss near its floor: 0.1 x lognormal with one log unit of step-to-step noise."""
    return 0.1 * np.exp(np.random.default_rng(seed).normal(0.0, 1.0, n))


def alarms_of(mon: Monitor, losses: np.ndarray) -> list[tuple[int, str, str]]:
    return [(s, a.detector, a.severity) for s, x in enumerate(losses)
            for a in mon.observe(s, {"loss": float(x)}).alarms]


@pytest.mark.parametrize("preset", ["default", "small", "llm_pretrain", "finetune"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_x1000_jump_near_the_floor_is_a_critical_linear_spike(preset: str, seed: int) -> None:
    loss = floor_noise(400, seed)
    loss[300] = 1000 * float(np.median(loss[:300]))
    found = alarms_of(Monitor(preset, alert_sinks=[], handler_timeout=None), loss)
    mine = [(s, sev) for s, d, sev in found if d == NAME]
    assert mine and mine[0] == (300, "critical"), mine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_floor_noise_alone_is_quiet(seed: int) -> None:
    loss = floor_noise(2000, seed)
    found = alarms_of(Monitor("small", alert_sinks=[], handler_timeout=None), loss)
    assert [a for a in found if a[1] == NAME] == []


def _replay(path: Path, preset: str) -> list[tuple[int, str]]:
    mon = Monitor(preset, alert_sinks=[], handler_timeout=None)
    return [(d.step, a.detector) for d in mon.replay(pq.read_table(path)) for a in d.alarms
            if a.detector == NAME]


@pytest.mark.skipif(not (BENCH / "labels.parquet").exists(), reason="bench14 absent")
@pytest.mark.parametrize("preset", ["default", "small"])
def test_quiet_on_the_committed_clean_runs_and_before_every_onset(preset: str) -> None:
    rows = pq.read_table(BENCH / "labels.parquet").to_pylist()
    for r in rows:
        onset = r["onset_step"] if r["onset_step"] is not None else 10**9
        early = [a for a in _replay(BENCH / "runs" / f"{r['run_id']}.parquet", preset)
                 if a[0] < onset]
        assert early == [], (r["run_id"], early)
    long_runs = sorted((DATA / "bench14_clean_long" / "runs").glob("*.parquet")) + sorted(
        (DATA / "bench28_sgd_small" / "runs").glob("*.parquet"))
    for path in long_runs:
        assert _replay(path, preset) == [], path.name
