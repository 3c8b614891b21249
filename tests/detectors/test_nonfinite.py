"""NonFiniteGuard: constructor / get_params consistency and threshold validation."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.nonfinite import NonFiniteGuard

from .naive import ref_nonfinite


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
