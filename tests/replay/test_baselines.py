"""Baselines behave as the rules they name, on synthetic streams."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from replay.baselines import BASELINES, baseline_alarms


def _table(loss: np.ndarray, grad: np.ndarray | None = None) -> pa.Table:
    cols = {"step": np.arange(loss.size), "loss": loss}
    if grad is not None:
        cols["grad_norm"] = grad
    return pa.table(cols)


def test_all_baselines_quiet_on_flat_and_nan_alarms() -> None:
    loss = np.full(400, 2.0)
    out = baseline_alarms(_table(loss))
    for name in ("ratio2x_w100_p5", "max10x_first100", "ratio3x_w10", "nan_only"):
        assert out[name].size == 0, name
    loss[300] = np.nan
    out = baseline_alarms(_table(loss), ["nan_only", "ratio3x_w10"])
    assert out["nan_only"].tolist() == [300]


def test_ratio_rules_ge_semantics() -> None:
    loss = np.full(300, 1.0)
    loss[200] = 3.0  # exactly 3x the 10-step mean
    assert baseline_alarms(_table(loss), ["ratio3x_w10"])["ratio3x_w10"].tolist() == [200]
    loss = np.full(300, 1.0)
    loss[200:204] = 2.5  # 4 steps only: no alarm with patience 5
    assert baseline_alarms(_table(loss), ["ratio2x_w100_p5"])["ratio2x_w100_p5"].size == 0
    loss[200:206] = 2.5
    assert baseline_alarms(_table(loss), ["ratio2x_w100_p5"])["ratio2x_w100_p5"][0] == 204


def test_max10x_first100() -> None:
    loss = np.linspace(5.0, 1.0, 500)
    loss[400] = 49.0
    assert baseline_alarms(_table(loss), ["max10x_first100"])["max10x_first100"].size == 0
    loss[450] = 50.0  # 10 x max(first 100) = 10 x 5.0
    assert baseline_alarms(_table(loss), ["max10x_first100"])["max10x_first100"].tolist() == [450]


def test_sigma6_and_ema_on_grad_norm() -> None:
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.01 * rng.normal(size=600)
    grad = 1.0 + 0.01 * rng.normal(size=600)
    grad[500] = 5.0
    out = baseline_alarms(_table(loss, grad), ["sigma6_128", "ema_z2.5"])
    assert 500 in out["sigma6_128"].tolist() and 500 in out["ema_z2.5"].tolist()


def test_river_detectors_flag_level_shift() -> None:
    rng = np.random.default_rng(1)
    loss = np.concatenate([2.0 + 0.05 * rng.normal(size=1000), 4.0 + 0.05 * rng.normal(size=500)])
    out = baseline_alarms(_table(loss), ["page_hinkley", "adwin"])
    for name in ("page_hinkley", "adwin"):
        a = out[name]
        assert a.size and a[a >= 1000].size and a[a >= 1000][0] < 1100, name


def test_unknown_baseline_and_missing_signal() -> None:
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline_alarms(_table(np.ones(10)), ["nope"])
    t = pa.table({"step": np.arange(10), "other": np.ones(10)})
    assert all(v.size == 0 for v in baseline_alarms(t).values())
    assert len(BASELINES) == 8
