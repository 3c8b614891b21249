"""NonFiniteGuard: constructor / get_params consistency and threshold validation."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.nonfinite import NonFiniteGuard

from .naive import ref_nonfinite


def test_get_params_rebuilds_the_guard() -> None:
    g = NonFiniteGuard(n_series=2, threshold=0.25)
    h = NonFiniteGuard(**g.get_params())
    assert h.get_params() == g.get_params() == {
        "n_series": 2, "threshold": 0.25, "freeze_on_alarm": False}
    x = np.array([[1.0, np.nan], [np.inf, 0.0]])
    np.testing.assert_array_equal(g.update_many(x)[1], h.update_many(x)[1])
    np.testing.assert_array_equal(h.update_many(x)[1], ~np.isfinite(x))


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold": 1.0}, r"'threshold' parameter of NonFiniteGuard must be a float in the range "
                         r"\[0.0, 1.0\)"),
    ({"threshold": -0.1}, "'threshold'"),
    ({"threshold": float("nan")}, "'threshold'"),
    ({"threshold": "0.5"}, "'threshold'"),
    ({"freeze_on_alarm": True}, "'freeze_on_alarm' parameter of NonFiniteGuard must be False"),
    ({"freeze_on_alarm": 1}, "'freeze_on_alarm'"),
])
def test_bad_parameters(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        NonFiniteGuard(**kwargs)


def test_set_threshold_is_validated() -> None:
    g = NonFiniteGuard()
    g.set_threshold(0.0)
    assert g.params[0] == 0.0
    with pytest.raises(ValueError, match="'threshold'"):
        g.set_threshold(1.5)
    assert g.threshold == 0.0


def test_kernel_matches_the_naive_reference() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4))
    x[rng.random(x.shape) < 0.05] = np.nan
    x[rng.random(x.shape) < 0.03] = np.inf
    x[rng.random(x.shape) < 0.03] = -np.inf
    miss = rng.random(x.shape) < 0.1
    scores, alarms = NonFiniteGuard(n_series=4).update_many(x, missing=miss)
    ref_s, ref_a = ref_nonfinite(x, miss)
    np.testing.assert_array_equal(alarms, ref_a)
    np.testing.assert_array_equal(scores[~miss] > 0.5, ref_s[~miss] > 0.5)
