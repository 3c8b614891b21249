"""UpdateStall: the kernel against a plain-Python reference, arming and patience."""

from __future__ import annotations

import math

import numpy as np
import pytest

from detectors.stall import UpdateStall


def ref_update_stall(x, threshold=2.0, eps=0.0, freeze_on_alarm=False):
    """Plain Python: one series, returns (scores, alarms)."""
    run, moved = 0, False
    scores, alarms = [], []
    for v in x:
        if not math.isfinite(v):
            scores.append(math.inf)
            alarms.append(True)
            continue
        still = abs(v) <= eps
        new_run = run + 1 if still else 0
        s = float(new_run) if moved else 0.0
        scores.append(s)
        alarms.append(s > threshold)
        if not (s > threshold and freeze_on_alarm):
            run = new_run
            moved = moved or not still
    return np.array(scores), np.array(alarms)


REFERENCES = {"no_update": ref_update_stall}


@pytest.mark.parametrize("params", [{}, {"eps": 1e-6}, {"threshold": 0.5},
                                    {"freeze_on_alarm": True}])
def test_kernel_matches_the_reference(params: dict) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1e-3, 300)
    x[:20] = 0.0                      # warm-up at LR 0: never moved yet
    x[100:110] = 0.0                  # the optimizer stops stepping
    x[150:152] = 1e-7
    x[[200, 250]] = [np.nan, np.inf]
    scores, alarms = UpdateStall(**params).update_many(x)
    rs, ra = ref_update_stall(x, **params)
    np.testing.assert_array_equal(scores[:, 0], rs)
    np.testing.assert_array_equal(alarms[:, 0], ra)


def test_per_layer_bank_flags_only_the_frozen_layer() -> None:
    rng = np.random.default_rng(1)
    x = rng.uniform(1e-4, 1e-3, (40, 3))
    x[:, 0] = 0.0        # never updated (an unused parameter): not flagged
    x[25:, 2] = 0.0      # updated, then frozen
    _, alarms = UpdateStall(n_series=3).update_many(x)
    assert np.flatnonzero(alarms.any(axis=0)).tolist() == [2]
    assert np.flatnonzero(alarms[:, 2])[0] == 27  # the third zero in a row
