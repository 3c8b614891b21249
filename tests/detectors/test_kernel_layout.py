"""The shared kernel pieces: parameter layouts declared once, and the public output buffers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import pytest

from detectors import Choice
from detectors._kernel import COMMON_FIELDS, indices
from stability.config.registry import REGISTRY, make_detector

NAMES = sorted(REGISTRY)


@pytest.mark.parametrize("name", NAMES)
def test_params_follow_the_declared_layout(name: str) -> None:
    """Every registered detector declares its ``params`` layout, and the array follows it."""
    det = make_detector(name, {}, n_series=2)
    layout = type(det).param_layout
    assert layout is not None, f"{name}: no param_layout"
    fields = layout._fields  # type: ignore[attr-defined]
    assert fields[:2] == COMMON_FIELDS
    params = det.params
    assert len(params) >= len(fields)
    assert params[0] == det.threshold
    assert params[1] == float(det.freeze_on_alarm)
    given = det._param_values()
    rules = type(det).parameter_constraints
    for k, f in enumerate(fields[2:], start=2):
        value = getattr(det, f)
        rule = rules.get(f)
        if f in given:
            want = given[f]
        elif isinstance(rule, Choice) and isinstance(rule.options, Mapping):
            want = rule.options[value]  # a declared choice: the kernel reads its number
        else:
            want = float(value)
        assert params[k] == want, f"{name}: params[{k}] is not {f}"


@pytest.mark.parametrize("name", NAMES)
def test_set_threshold_writes_the_threshold_field(name: str) -> None:
    det = make_detector(name, {}, n_series=1)
    new = det.threshold / 2.0 + 0.25
    det.set_threshold(new)
    layout = type(det).param_layout
    assert det.params[indices(layout).threshold] == new  # type: ignore[arg-type]


def test_indices_are_positions_and_bad_layouts_are_refused() -> None:
    class Good(NamedTuple):
        threshold: float
        freeze_on_alarm: float
        alpha: float

    class Bad(NamedTuple):
        alpha: float
        threshold: float

    assert indices(Good) == Good(0, 1, 2)
    with pytest.raises(TypeError, match="threshold"):
        indices(Bad)
    with pytest.raises(TypeError):
        indices(dict)


@pytest.mark.parametrize("name", NAMES)
def test_bind_outputs_receives_the_updates(name: str) -> None:
    """Bound arrays (views of a larger vector, as the monitor uses) get every update."""
    det = make_detector(name, {}, n_series=3)
    ref = make_detector(name, {}, n_series=3)
    big_s = np.full(7, -1.0)
    big_a = np.zeros(7, dtype=np.bool_)
    s_view, a_view = big_s[2:5].reshape(1, 3), big_a[2:5].reshape(1, 3)
    det.bind_outputs(s_view, a_view)
    rng = np.random.default_rng(0)
    for _ in range(40):
        xs = [np.exp(rng.normal(0.0, 0.1, 3)) for _ in range(det.n_inputs)]
        det.update(*xs)
        ref.update(*xs)
        np.testing.assert_array_equal(big_s[2:5], ref.score)
        np.testing.assert_array_equal(big_a[2:5], ref.alarm)
        assert det.score.base is not None
    assert (big_s[:2] == -1.0).all() and (big_s[5:] == -1.0).all()


def test_bind_outputs_checks_shapes_and_dtypes() -> None:
    det = make_detector(NAMES[0], {}, n_series=2)
    with pytest.raises(ValueError, match="scores"):
        det.bind_outputs(np.zeros((1, 3)), np.zeros((1, 2), dtype=np.bool_))
    with pytest.raises(ValueError, match="scores"):
        det.bind_outputs(np.zeros((1, 2), dtype=np.float32), np.zeros((1, 2), dtype=np.bool_))
    with pytest.raises(ValueError, match="alarms"):
        det.bind_outputs(np.zeros((1, 2)), np.zeros((1, 2)))
