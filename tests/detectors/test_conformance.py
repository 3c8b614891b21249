"""Conformance suite: every registered detector, with its default parameters, keeps the contract.

Parametrised over :data:`stability.registry.REGISTRY` (river's ``utils.estimator_checks``
pattern), so a newly registered detector is checked without writing these tests again: stream ==
batch bit for bit (with missing values), chunked batches == one batch, state round trips (also
through JSON) continue identically, a missing step is invisible, and a lower threshold never
gives fewer alarms.  Each entry must also have its own reference test module.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from stability.registry import REGISTRY, detector_class, make_detector
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


@pytest.mark.parametrize("name", NAMES)
def test_stream_equals_batch_and_chunks(name: str) -> None:
    xs = _inputs(name)
    miss = _missing(xs, slice(None, None, 7), 1)
    check_stream_equals_batch(_factory(name), *xs, missing=miss)
    check_split_batches(_factory(name), *xs)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split", [1, 50, 251])
def test_state_round_trip_continues_identically(name: str, split: int) -> None:
    xs = _inputs(name, seed=split)
    check_state_roundtrip(_factory(name), *xs, split=split)
    check_state_roundtrip(_factory(name), *xs, split=split, via_json=True)


@pytest.mark.parametrize("name", NAMES)
def test_missing_steps_are_invisible(name: str) -> None:
    xs = _inputs(name, seed=3)
    miss = _missing(xs, slice(100, 140))
    s_gap, a_gap = make_detector(name, {}, n_series=N).update_many(*xs, missing=miss)
    keep = np.ones(T, dtype=bool)
    keep[100:140] = False
    s_ref, a_ref = make_detector(name, {}, n_series=N).update_many(*(x[keep] for x in xs))
    assert_same(s_gap[keep], s_ref)
    assert_same(a_gap[keep], a_ref)


@pytest.mark.parametrize("name", NAMES)
def test_lower_threshold_never_fewer_alarms(name: str) -> None:
    cls = detector_class(name)
    args = inspect.signature(cls).parameters
    if "threshold" not in args or getattr(cls, "fixed_threshold", False):
        pytest.skip(f"{name} has no tunable threshold")
    default = args["threshold"].default
    xs = _inputs(name, seed=5)
    extra = {"freeze_on_alarm": False} if "freeze_on_alarm" in args else {}
    counts = [int(make_detector(name, {"threshold": default * f, **extra}, n_series=N)
                  .update_many(*xs)[1].sum()) for f in (0.5, 1.0, 2.0)]
    assert counts[0] >= counts[1] >= counts[2], counts


@pytest.mark.parametrize("name", NAMES)
def test_every_entry_has_a_naive_reference_and_a_test_module(name: str) -> None:
    from tests.detectors.naive import REFERENCES

    assert name in REFERENCES, f"{name}: add its naive reference to tests/detectors/naive.py"
    module = REGISTRY[name].target.split(":")[0].split(".")[-1]
    here = Path(__file__).parent
    assert (here / f"test_{module}.py").exists(), f"{name}: no tests/detectors/test_{module}.py"
