"""``stability replay --calibrate HISTORY``: a run that starts near an event is not blind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.cli import main
from replay.replay import replay_run


def _write(path: Path, steps: np.ndarray, loss: np.ndarray) -> str:
    pq.write_table(pa.table({"step": steps, "loss": loss}), path)
    return str(path)


def _files(tmp_path: Path) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    hist = 3.0 * np.exp(0.01 * rng.standard_normal(300))
    window = 3.0 * np.exp(0.01 * rng.standard_normal(20))
    window[5] = 9.0  # a 3x loss spike on the sixth row of the short log
    return (_write(tmp_path / "history.parquet", np.arange(300), hist),
            _write(tmp_path / "window.parquet", np.arange(1000, 1020), window))


#: a loss-spike binding without a prior: silent for its first 100 values
NO_PRIOR = {"detectors": [{"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
                           "kind": "loss_spike",
                           "params": {"warmup": 100, "min_std": 0.12, "threshold": 6.0}}]}


def test_calibration_primes_the_detectors_of_a_short_window(tmp_path: Path) -> None:
    hist, window = _files(tmp_path)
    blind = replay_run(window, NO_PRIOR)
    primed = replay_run(window, NO_PRIOR, calibrate=hist)
    assert [a.step for a in blind.alarms] == []
    assert [(a.step, a.kind) for a in primed.alarms] == [(1005, "loss_spike")]
    assert primed.n_steps == blind.n_steps == 20


def test_the_presets_priors_flag_it_without_history(tmp_path: Path) -> None:
    _, window = _files(tmp_path)
    for preset in ("default", "llm_pretrain"):
        assert (1005, "loss_spike") in {(a.step, a.kind) for a in replay_run(window, preset).alarms}


def test_the_cli_flag(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    hist, window = _files(tmp_path)
    cfg = tmp_path / "no_prior.json"
    cfg.write_text(json.dumps(NO_PRIOR), encoding="utf-8")
    assert main(["replay", window, "-c", str(cfg), "--calibrate", hist]) == 0
    assert "first at step 1005: loss_spike" in capsys.readouterr().out
