"""Every detector fed hostile streams: non-finite values, extremes, constants, bad shapes/types.

Properties (all detectors discovered in ``detectors/``):

* a non-finite value in any input of a series is invisible to the statistics: the state after
  the stream equals the state of a detector that saw that series' step as *not logged*, and every
  other score is identical (contract: non-finite -> score ``+inf`` + alarm, never enters state);
* a step where nothing was logged is exactly the same as the step not existing;
* extreme finite values (``±1e308``, subnormals, exact zeros) never make the state non-finite and
  the detector still produces finite scores on ordinary data afterwards;
* constant streams give finite scores and no alarms (except the detectors declared in
  ``FLAGS_CONSTANT_STREAMS``, whose rule flags a level that does not move: one steady verdict);
* bad shapes / types raise ``ValueError`` (never another exception type).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detectors.nonfinite import NonFiniteGuard

from ._detectors import all_detector_classes

CLASSES = all_detector_classes()
STATEFUL = [c for c in CLASSES if c is not NonFiniteGuard]
IDS = [c.__name__ for c in CLASSES]
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _stream(seed: int, t: int, k: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = np.abs(1.0 + 0.1 * rng.standard_normal((t, k, n)))
    spikes = rng.random((t, k, n)) < 0.02
    return np.where(spikes, base * 30.0, base)


def _run(det, x: np.ndarray, miss: np.ndarray):  # type: ignore[no-untyped-def]
    k = x.shape[1]
    return det.update_many(*[x[:, j] for j in range(k)], missing=miss)


def test_every_detector_module_is_covered() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"EWMAZScore", "RobustZScore", "RatioToMean", "NonFiniteGuard"} <= names
    assert len(CLASSES) >= 10, names


@pytest.mark.parametrize("cls", STATEFUL, ids=[c.__name__ for c in STATEFUL])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(0, 400), n=st.integers(1, 3),
       bad_frac=st.sampled_from([0.0, 0.02, 0.2, 0.9]), freeze=st.booleans())
def test_nonfinite_is_treated_as_not_logged(cls, seed, t, n, bad_frac, freeze) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed + 1)
    try:
        a, b = cls(n_series=n, freeze_on_alarm=freeze), cls(n_series=n, freeze_on_alarm=freeze)
    except ValueError:  # e.g. ADWIN has no freeze mode
        a, b = cls(n_series=n), cls(n_series=n)
    k = a.n_inputs
    x = _stream(seed, t, k, n)
    miss = rng.random((t, k, n)) < 0.05
    bad = (rng.random((t, k, n)) < bad_frac) & ~miss
    xa = x.copy()
    xa[bad] = rng.choice([np.nan, np.inf, -np.inf], size=int(bad.sum()))
    # B: the series' whole step is "not logged" wherever A had a non-finite input
    row_bad = bad.any(axis=1)  # (t, n)
    miss_b = miss | row_bad[:, None, :]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning (overflow, invalid) either
        sa, aa = _run(a, xa, miss)
        sb, ab = _run(b, x, miss_b)
    np.testing.assert_array_equal(a._state, b._state)
    np.testing.assert_array_equal(a._buf, b._buf)
    np.testing.assert_array_equal(sa[~row_bad], sb[~row_bad])
    np.testing.assert_array_equal(aa[~row_bad], ab[~row_bad])
    # a non-finite value alarms (where another input of the series is *not logged* on the same
    # step, detectors differ: lr_loss's scores are nan there, divergence's +inf -- both tolerated)
    strict_rows = row_bad & ~miss.any(axis=1)
    assert np.all(sa[strict_rows] == np.inf) and np.all(aa[strict_rows])


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 300), n=st.integers(1, 3))
def test_unlogged_steps_are_invisible(cls, seed, t, n) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    a, b = cls(n_series=n), cls(n_series=n)
    k = a.n_inputs
    x = _stream(seed, t, k, n)
    if cls is NonFiniteGuard:
        x[rng.random(x.shape) < 0.1] = np.nan
    gap = rng.random(t) < 0.3
    miss = np.zeros((t, k, n), dtype=bool)
    miss[gap] = True
    xa = x.copy()
    xa[gap] = 12345.0  # the value of an unlogged entry is irrelevant
    sa, aa = _run(a, xa, miss)
    sb, ab = _run(b, x[~gap], miss[~gap])
    np.testing.assert_array_equal(a._state, b._state)
    np.testing.assert_array_equal(a._buf, b._buf)
    np.testing.assert_array_equal(sa[~gap], sb)
    np.testing.assert_array_equal(aa[~gap], ab)
    assert np.all(np.isnan(sa[gap])) and not aa[gap].any()


def test_nonfinite_guard_alarms_exactly_on_nonfinite() -> None:
    x = np.array([1.0, np.nan, 0.0, np.inf, -np.inf, 1e308, -1e308, 5e-324, 2.0])
    s, a = NonFiniteGuard(n_series=1).update_many(x)
    np.testing.assert_array_equal(a[:, 0], ~np.isfinite(x))


EXTREMES = np.array([1e308, -1e308, 1.7976931348623157e308, 5e-324, -5e-324, 0.0, -0.0,
                     1e-308, 1e300, -1e300])


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_extreme_finite_values_keep_state_finite(cls, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    det, fresh = cls(n_series=3), cls(n_series=3)
    sentinel = ~np.isfinite(fresh._state)  # fields a detector initialises to +-inf / nan
    k = det.n_inputs
    x = _stream(seed, 600, k, 3)
    hit = rng.random(x.shape) < 0.1
    x[hit] = rng.choice(EXTREMES, size=int(hit.sum()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run(det, x, np.zeros(x.shape, dtype=bool))
    bad_fields = np.argwhere(~np.isfinite(det._state) & ~sentinel)
    assert bad_fields.size == 0, f"{cls.__name__}: state fields became non-finite: " \
        f"{bad_fields[:6].tolist()}"
    assert np.isfinite(det._buf).all(), f"{cls.__name__}: buffer became non-finite"
    after = _stream(seed + 7, 300, k, 3)
    s, _ = _run(det, after, np.zeros(after.shape, dtype=bool))
    assert np.isfinite(s).all(), f"{cls.__name__}: scores are not finite after extreme values"


#: Detectors whose rule is that a level does *not* move, so a constant stream is the very fault
#: they flag (declared here, with the reason, so that each exemption is a visible decision).
#: They still owe finite scores and one steady verdict: once a constant stream alarms, every
#: later step alarms too (no flapping), and every series agrees.
FLAGS_CONSTANT_STREAMS = {
    "NoProgress": "loss not decreasing (opt-in): a positive loss that stays at its starting "
                  "level for `horizon` values has not started learning (LR 0, frozen model)",
}


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
@pytest.mark.parametrize("const", [0.0, -0.0, 1.0, -5.0, 5e-324, 1e-300, 1e8, 1e300])
def test_constant_streams(cls, const: float) -> None:  # type: ignore[no-untyped-def]
    det = cls(n_series=2)
    x = np.full((500, det.n_inputs, 2), const)
    s, a = _run(det, x, np.zeros(x.shape, dtype=bool))
    assert np.isfinite(s).all()
    if cls.__name__ in FLAGS_CONSTANT_STREAMS:
        first = int(np.argmax(a[:, 0])) if a[:, 0].any() else len(a)
        assert not a[:first].any() and a[first:].all(), f"{cls.__name__}: flapping on {const}"
        return
    assert not a.any(), f"{cls.__name__}: alarm on a constant {const} stream"


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_bad_shapes_and_types_raise_value_error(cls) -> None:  # type: ignore[no-untyped-def]
    det = cls(n_series=2)
    k = det.n_inputs
    ok = [np.ones(2)] * k
    bad_inputs = [
        [np.ones(3)] + ok[1:],          # wrong length
        [np.ones((2, 2))] + ok[1:],     # wrong rank
        ["abc"] + ok[1:],               # string
        [None] + ok[1:],                # None
        [np.array(["a", "b"])] + ok[1:],
        [object()] + ok[1:],
        [1.0] + ok[1:],                 # scalar for a bank of 2
        ok + [np.ones(2)],              # too many inputs
    ]
    for inputs in bad_inputs:
        with pytest.raises(ValueError):
            det.update(*inputs)
    with pytest.raises(ValueError):
        det.update_many(*[np.ones((5, 3))] * k)
    with pytest.raises(ValueError):
        det.update_many(*[np.ones((5, 2, 1))] * k)
    with pytest.raises(ValueError):
        det.update_many(*[np.ones((5, 2))] * k, missing=np.zeros((4, k, 2), dtype=bool))
    # nothing of the above touched the state
    np.testing.assert_array_equal(det._state, cls(n_series=2)._state)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_empty_and_growing_banks(cls) -> None:  # type: ignore[no-untyped-def]
    det = cls(n_series=0)
    k = det.n_inputs
    s, a = det.update_many(*[np.zeros((10, 0))] * k)
    assert s.shape == (10, 0)
    det.grow(2)
    s, a = det.update_many(*[np.zeros((0, 2))] * k)
    assert s.shape == (0, 2)
    x = _stream(3, 200, k, 2)
    det.update_many(*[x[:, j] for j in range(k)])
    det.grow(1)  # a layer appears mid-run: fresh series, the others untouched
    x3 = _stream(4, 50, k, 3)
    s, _ = det.update_many(*[x3[:, j] for j in range(k)])
    assert np.isfinite(s).all()


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_get_params_rebuilds_the_detector(cls) -> None:  # type: ignore[no-untyped-def]
    det = cls(n_series=2)
    again = cls(**det.get_params())
    assert again.get_params() == det.get_params()
    np.testing.assert_array_equal(again.params, det.params)
