"""NoProgress: the kernel against a plain-Python reference, and what it flags."""

from __future__ import annotations

import math

import numpy as np
import pytest

from detectors.progress import NoProgress

BIGGEST = float(np.finfo(np.float64).max)


def ref_no_progress(x, threshold=0.97, window=50, horizon=300, alpha=0.02,
                    freeze_on_alarm=False):
    """Plain Python: one series, returns (scores, alarms)."""
    seen: list[float] = []
    ewm = 0.0
    scores, alarms = [], []
    for v in x:
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        n = len(seen)
        s = 0.0
        if n >= horizon and n > 0:
            first = seen[:window]
            s = ewm / max(sum(first) / len(first), 1e-300)
            s = max(-BIGGEST, min(s, BIGGEST))  # saturated, never inf
        scores.append(s)
        alarms.append(s > threshold)
        if s > threshold and freeze_on_alarm:
            continue
        a = max(alpha, 1.0 / (n + 1))
        new_ewm = ewm + a * (v - ewm)
        new_ref = sum(seen) + v if n < window else 0.0
        if not (math.isfinite(new_ewm) and math.isfinite(new_ref)):
            scores[-1], alarms[-1] = math.inf, True  # overflow: alarms, never learned
            continue
        ewm = new_ewm
        seen.append(v)
    return np.array(scores), np.array(alarms)


REFERENCES = {"no_progress": ref_no_progress}


@pytest.mark.parametrize("params", [{}, {"horizon": 5, "window": 3}, {"freeze_on_alarm": True},
                                    {"alpha": 0.2, "threshold": 0.9}])
def test_kernel_matches_the_reference(params: dict) -> None:
    rng = np.random.default_rng(0)
    x = 2.0 * np.exp(rng.normal(0.0, 0.1, 500))
    x[250:] *= np.linspace(1.0, 0.7, 250)
    x[[10, 320, 400]] = [np.nan, np.inf, -np.inf]
    scores, alarms = NoProgress(**params).update_many(x)
    rs, ra = ref_no_progress(x, **params)
    np.testing.assert_allclose(scores[:, 0], rs, rtol=1e-12)
    np.testing.assert_array_equal(alarms[:, 0], ra)


def test_a_noisy_learning_loss_is_quiet_and_a_noisy_flat_one_is_not() -> None:
    rng = np.random.default_rng(3)
    noise = np.exp(rng.normal(0.0, 0.3, 600))  # small-batch noise, 30 % per step
    learning = 3.0 * noise * np.linspace(1.0, 0.7, 600)  # 15 % down by step 300
    flat = 3.0 * noise
    assert not NoProgress().update_many(learning)[1].any()
    assert NoProgress().update_many(flat)[1][300:].mean() > 0.9


def test_overflowing_values_stay_out_and_ratios_saturate() -> None:
    """``+-1e308`` would overflow the sums: they alarm and never enter; tiny initial values put
    a later level far past the float64 range: the score saturates (finite, alarming)."""
    x = np.full(40, 1e-300)
    x[[3, 4, 5, 20, 30]] = [1e308, 1e308, -1e308, 1e308, -1e308]
    x[25:] = 1e10
    params = {"horizon": 10, "window": 5}
    det = NoProgress(**params)
    scores, alarms = det.update_many(x)
    with np.errstate(over="ignore"):  # the reference's float64 sums overflow where it says so
        rs, ra = ref_no_progress(x, **params)
    np.testing.assert_array_equal(scores[:, 0], rs)
    np.testing.assert_array_equal(alarms[:, 0], ra)
    assert np.isfinite(det._state).all()
    assert scores[4, 0] == np.inf and alarms[4, 0]  # 1e308 + 1e308: out
    assert scores[-1, 0] == BIGGEST and alarms[-1, 0]


@pytest.mark.parametrize("const", [1e-300, 1.0, 2.3, 1e8, 1e300])
def test_a_constant_positive_loss_alarms_from_the_horizon(const: float) -> None:
    """A loss that never leaves its starting level is the fault: every value from ``horizon``."""
    scores, alarms = NoProgress(n_series=2, horizon=300).update_many(np.full((500, 2), const))
    assert not alarms[:300].any() and alarms[300:].all()
    np.testing.assert_allclose(scores[300:], 1.0, rtol=1e-12)


@pytest.mark.parametrize("const", [0.0, -0.0, -5.0, 5e-324])
def test_a_zero_or_negative_constant_is_not_flagged(const: float) -> None:
    """The rule is for a positive loss: a non-positive initial level never alarms."""
    assert not NoProgress(n_series=2).update_many(np.full((500, 2), const))[1].any()
