"""Conformance suite: every registered detector, with its default parameters, keeps the contract.

Parametrised over :data:`stability.config.registry.REGISTRY` (river's ``utils.estimator_checks``
pattern), so a newly registered detector is checked without writing these tests again: stream ==
batch bit for bit (with missing values), chunked batches == one batch, state round trips (also
through JSON) continue identically, a missing step is invisible, a non-finite value alarms and
never enters the state, zero steps change nothing, bad parameters raise naming the parameter, and
a lower threshold never gives fewer alarms.  Each entry must also have a reference test module
with a naive reference (:func:`check_reference`).

Every check is a plain function of the registry name (:data:`CHECKS`), so
``test_add_detector.py`` runs the same suite on a detector registered at test time.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from stability.config.registry import REGISTRY, detector_class, make_detector
from tests.detectors.generic import (
    assert_same,
    check_split_batches,
    check_state_roundtrip,
    check_stream_equals_batch,
)

NAMES = sorted(REGISTRY)
T, N = 400, 3


def _inputs(name: str, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Positive, noisy, trending streams (one per input) with a few spikes and a level shift."""
    det = make_detector(name, {}, n_series=N)
    rng = np.random.default_rng(seed)
    out = []
    for j in range(det.n_inputs):
        base = np.exp(rng.normal(0.0, 0.05, (T, N))) * (1.0 + 0.3 * j)
        base *= np.linspace(2.0, 1.0, T)[:, None]
        base[200::97] *= 8.0
        base[300:] *= 1.5
        out.append(base)
    return tuple(out)


def _missing(xs: tuple[np.ndarray, ...], rows: slice | np.ndarray, cols: object = slice(None)
             ) -> np.ndarray:
    """A missing mask shaped as ``update_many`` wants it: (T, N), or (T, k, N) for k inputs."""
    miss = np.zeros((T, N), dtype=bool)
    miss[rows, cols] = True  # type: ignore[index]
    if len(xs) > 1:
        miss = np.repeat(miss[:, None, :], len(xs), axis=1)
    return miss


def _factory(name: str, **params: object):  # type: ignore[no-untyped-def]
    return lambda n: make_detector(name, params, n_series=n)


# ---------------------------------------------------------------------------- the checks
def check_stream_equals_batch_and_chunks(name: str) -> None:
    xs = _inputs(name)
    miss = _missing(xs, slice(None, None, 7), 1)
    check_stream_equals_batch(_factory(name), *xs, missing=miss)
    check_split_batches(_factory(name), *xs)


def check_state_round_trips(name: str, splits: tuple[int, ...] = (1, 50, 251)) -> None:
    for split in splits:
        xs = _inputs(name, seed=split)
        check_state_roundtrip(_factory(name), *xs, split=split)
        check_state_roundtrip(_factory(name), *xs, split=split, via_json=True)


def check_missing_steps_are_invisible(name: str) -> None:
    xs = _inputs(name, seed=3)
    miss = _missing(xs, slice(100, 140))
    s_gap, a_gap = make_detector(name, {}, n_series=N).update_many(*xs, missing=miss)
    keep = np.ones(T, dtype=bool)
    keep[100:140] = False
    s_ref, a_ref = make_detector(name, {}, n_series=N).update_many(*(x[keep] for x in xs))
    assert_same(s_gap[keep], s_ref)
    assert_same(a_gap[keep], a_ref)


def check_non_finite_alarms_and_stays_out(name: str) -> None:
    """A NaN / +inf / -inf in every input of a step alarms (score +inf) on that step, and the
    later steps are those of the stream with that step missing (detectors of kind
    ``nonfinite`` count non-finite values: for them only the alarm is required)."""
    xs = _inputs(name, seed=4)
    rows = [120, 180, 260]
    bad = [x.copy() for x in xs]
    for r, v in zip(rows, (np.nan, np.inf, -np.inf), strict=True):
        for b in bad:
            b[r] = v
    s_bad, a_bad = make_detector(name, {}, n_series=N).update_many(*bad)
    assert a_bad[rows].all(), f"{name}: a non-finite value must alarm"
    if REGISTRY[name].kind == "nonfinite":
        return
    assert np.isposinf(s_bad[rows]).all(), f"{name}: a non-finite value must score +inf"
    s_ref, a_ref = make_detector(name, {}, n_series=N).update_many(
        *xs, missing=_missing(xs, np.array(rows)))
    keep = np.ones(T, dtype=bool)
    keep[rows] = False
    assert_same(s_bad[keep], s_ref[keep])
    assert_same(a_bad[keep], a_ref[keep])


def check_zero_steps_change_nothing(name: str) -> None:
    det = make_detector(name, {}, n_series=N)
    xs = _inputs(name, seed=6)
    det.update_many(*(x[:50] for x in xs))
    before = det.state_dict()
    scores, alarms = det.update_many(*(x[:0] for x in xs))
    assert scores.shape == alarms.shape == (0, N)
    after = det.state_dict()
    for key in ("state", "buf", "score", "alarm"):
        assert_same(before[key], after[key])


def check_bad_parameters_name_the_parameter(name: str) -> None:
    cls = detector_class(name)
    args = inspect.signature(cls).parameters
    with pytest.raises(ValueError, match=f"'n_series' parameter of {cls.__name__}"):
        cls(n_series=-1)
    if "threshold" in args:
        with pytest.raises(ValueError, match=f"'threshold' parameter of {cls.__name__}"):
            cls(threshold=float("nan"))
    if "freeze_on_alarm" in args:
        with pytest.raises(ValueError, match=f"'freeze_on_alarm' parameter of {cls.__name__}"):
            cls(freeze_on_alarm="yes")


def check_lower_threshold_never_fewer_alarms(name: str) -> None:
    cls = detector_class(name)
    args = inspect.signature(cls).parameters
    if "threshold" not in args or getattr(cls, "fixed_threshold", False):
        return  # nothing to tune
    default = args["threshold"].default
    xs = _inputs(name, seed=5)
    extra = {"freeze_on_alarm": False} if "freeze_on_alarm" in args else {}
    counts = [int(make_detector(name, {"threshold": default * f, **extra}, n_series=N)
                  .update_many(*xs)[1].sum()) for f in (0.5, 1.0, 2.0)]
    assert counts[0] >= counts[1] >= counts[2], counts


def reference_test_module(name: str) -> ModuleType:
    """``tests/detectors/test_<module>.py`` of the module that defines ``name``'s class."""
    module = REGISTRY[name].target.split(":")[0].split(".")[-1]
    try:
        return importlib.import_module(f"tests.detectors.test_{module}")
    except ModuleNotFoundError:
        raise AssertionError(f"{name}: no tests/detectors/test_{module}.py") from None


def check_reference(name: str, test_module: ModuleType | None = None) -> None:
    """``name`` has a naive reference: in ``tests/detectors/naive.py``'s ``REFERENCES`` or in
    the ``REFERENCES`` of its own test module (which must exist)."""
    from tests.detectors.naive import REFERENCES

    mod = reference_test_module(name) if test_module is None else test_module
    refs = {**REFERENCES, **getattr(mod, "REFERENCES", {})}
    assert callable(refs.get(name)), (
        f"{name}: add its naive reference to REFERENCES in {mod.__name__} or "
        "tests/detectors/naive.py")


#: every generic check, by name (each takes the registry name)
CHECKS: dict[str, Callable[[str], None]] = {
    "stream_equals_batch_and_chunks": check_stream_equals_batch_and_chunks,
    "state_round_trips": check_state_round_trips,
    "missing_steps_are_invisible": check_missing_steps_are_invisible,
    "non_finite_alarms_and_stays_out": check_non_finite_alarms_and_stays_out,
    "zero_steps_change_nothing": check_zero_steps_change_nothing,
    "bad_parameters_name_the_parameter": check_bad_parameters_name_the_parameter,
    "lower_threshold_never_fewer_alarms": check_lower_threshold_never_fewer_alarms,
}


# ---------------------------------------------------------------------------- the suite
@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("name", NAMES)
def test_conformance(name: str, check: str) -> None:
    CHECKS[check](name)


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_has_a_naive_reference_and_a_test_module(name: str) -> None:
    check_reference(name)
