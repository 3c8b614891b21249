"""Conformance suite: every registered detector, with its default parameters, keeps the contract.

Parametrised over :data:`stability.config.registry.REGISTRY` (river's ``utils.estimator_checks``
pattern), so a newly registered detector is checked without writing these tests again: stream ==
batch bit for bit (with missing values), chunked batches == one batch, state round trips (also
through JSON) continue identically, a missing step is invisible, a non-finite value alarms and
never enters the state, zero steps change nothing, a lower threshold never gives fewer alarms,
bad inputs raise saying what was expected, and -- from the class's declared
``parameter_constraints`` -- every argument refuses what its rule excludes with the scikit-learn
message and accepts its range's ends, and the declaration is the signature, ``hyperparameters``
and ``get_params``.  Each entry must also have a reference test module
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

from detectors._base import COMMON_PARAMETERS
from detectors.validation import short_repr
from stability.config.registry import REGISTRY, detector_class, make_detector
from stability.config.registry_docs import parameter_docs
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
    """Driven by the class's declaration (``parameter_constraints``): every argument refuses
    the values its constraint puts outside it (just past each end, the wrong type) with the
    scikit-learn message naming the class, the argument, its rule and the value, and accepts
    the closed ends of its range (another argument's rule may then object, never its own)."""
    cls = detector_class(name)
    base = cls()
    for arg, rule in cls.parameter_constraints.items():
        for bad, says in rule.invalid(base):
            with pytest.raises(ValueError) as info:
                cls(**{arg: bad})
            assert str(info.value) == (f"The '{arg}' parameter of {cls.__name__} must be "
                                       f"{says}. Got {short_repr(bad)} instead.")
        for edge in rule.edges(base):
            try:
                cls(**{arg: edge})
            except ValueError as exc:
                assert f"'{arg}' parameter" not in str(exc), (arg, edge, exc)


def check_declaration_is_the_interface(name: str) -> None:
    """The signature is ``n_series, threshold, freeze_on_alarm`` and ``hyperparameters`` (the
    declared arguments, for a class that declares them); ``get_params`` gives them in that
    order and a detector rebuilt from it is the same; every argument is documented."""
    cls = detector_class(name)
    names = [*COMMON_PARAMETERS, *cls.hyperparameters]
    assert sorted(inspect.signature(cls).parameters) == sorted(names)
    assert set(cls.parameter_constraints) <= set(names)
    det = cls()
    assert list(det.get_params()) == names
    again = cls(**det.get_params())
    assert again.get_params() == det.get_params()
    np.testing.assert_array_equal(again.params, det.params)
    undocumented = [a for a in names if not parameter_docs(cls).get(a)]
    assert not undocumented, f"{cls.__name__}: document {undocumented} under Parameters"


def check_bad_inputs_have_clear_errors(name: str) -> None:
    """Wrong shapes, counts and types of inputs raise a ``ValueError`` saying what was
    expected (the contract of ``BankDetector.update`` / ``update_many``)."""
    det = make_detector(name, {}, n_series=N)
    k = det.n_inputs
    ones = (np.ones(N),) * k
    with pytest.raises(ValueError, match=rf"shape \(2,\); expected \({N},\)"):
        det.update(*((np.ones(2),) * k))
    with pytest.raises(ValueError, match="must be numeric"):
        det.update(*((["a"] * N,) * k))
    with pytest.raises(ValueError, match="scalar"):
        det.update(*((1.0,) * k))
    with pytest.raises(ValueError, match=rf"takes {k} input\(s\)"):
        det.update(*ones, np.ones(N))
    with pytest.raises(ValueError, match=rf"expected \(steps, {N}\)"):
        det.update_many(*((np.ones((5, 2)),) * k))
    with pytest.raises(ValueError, match="'missing' has shape"):
        det.update_many(*((np.ones((5, N)),) * k), missing=np.zeros((4, N), dtype=bool))
    if k > 1:
        with pytest.raises(ValueError, match="different numbers of steps"):
            det.update_many(np.ones((5, N)), *((np.ones((4, N)),) * (k - 1)))


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
    "declaration_is_the_interface": check_declaration_is_the_interface,
    "bad_inputs_have_clear_errors": check_bad_inputs_have_clear_errors,
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
