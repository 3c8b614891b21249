"""Adding a detector touches three files: its module, its registry line, its reference test.

This test plays a contributor adding ``mean_z`` (a z-score against the running mean/variance of
all past values): it writes the detector module into the ``detectors`` package and the reference
test next to it (both in a temporary directory), registers the name with the registry API (the
one line of ``BUILTIN`` in ``stability/config/registry.py``), and then shows, without touching
any other file, that the detector

* is importable from the package root (``detectors.MeanZ``),
* works by name in a monitor config and alarms on a spike,
* is tuned (its registry grid reaches :func:`replay.tuning.make_candidates`),
* has its rows in the generated detectors-page / CONTRACTS tables,
* passes every check of the conformance suite and its own reference test.

The module declares its parameters (``parameter_constraints``) and its registry metadata
(``kind``, ``tuning_grid``, ``summary``) on the class.  A detector written the older way (a
``check_*`` call per parameter in ``__init__``, the metadata given to ``register_detector``)
keeps working: every test runs on both.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import detectors
from stability import Monitor
from stability.config import registry
from stability.config.registry import REGISTRY, register_detector, tune_grids
from stability.config.registry_docs import contracts_table, detectors_table
from tests.detectors.test_conformance import CHECKS, check_reference

#: file 1: detectors/mean_z.py -- kernel, parameter layout, class
DETECTOR = '''
"""Z-score against the running mean and variance of all past values (Welford)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ._base import BankDetector, FloatArray
from ._kernel import indices, learns, skip_value
from ._params import Float, Int, arguments
from ._state import StateCheck


class MeanZParams(NamedTuple):
    threshold: float
    freeze_on_alarm: float
    warmup: float
    min_std: float


P = indices(MeanZParams)
COUNT, MEAN, M2 = 0, 1, 2


@njit(cache=True, error_model="numpy")
def _mean_z_kernel(X, miss, state, buf, params, scores, alarms):
    for t in range(X.shape[0]):
        for i in range(X.shape[2]):
            x = X[t, 0, i]
            if skip_value(miss[t, 0, i], x, scores, alarms, t, i):
                continue
            n = state[COUNT, i]
            s = 0.0
            if n >= params[P.warmup] and n > 1:
                std = max(np.sqrt(state[M2, i] / (n - 1.0)), params[P.min_std])
                s = abs(x - state[MEAN, i]) / std
            scores[t, i] = s
            alarms[t, i] = s > params[P.threshold]
            if learns(alarms[t, i], params[P.freeze_on_alarm]):
                n += 1.0
                d = x - state[MEAN, i]
                state[MEAN, i] += d / n
                state[M2, i] += d * (x - state[MEAN, i])
                state[COUNT, i] = n


class MeanZ(BankDetector):
    """``|x - mean| / std`` over every past value of each series.

    Parameters
    ----------
    n_series
        Number of series in the bank.
    threshold
        Alarm when the score exceeds this.
    warmup
        Values seen before the first score.
    min_std
        Floor of the standard deviation.
    freeze_on_alarm
        Do not learn a value that alarms.
    """

    kernel = _mean_z_kernel
    param_layout = MeanZParams
    parameter_constraints = {"warmup": Int(2), "min_std": Float(0.0, low_open=True)}
    kind = "loss_spike"
    tuning_grid = {"warmup": (10, 30)}
    summary = "z-score against all past values."

    def __init__(self, n_series=1, threshold=6.0, warmup=10, min_std=1e-3,
                 freeze_on_alarm=True):
        super().__init__(**arguments(locals()))

    def _init_state(self, n: int) -> FloatArray:
        return np.zeros((3, n))

    def _check_state(self, c: StateCheck) -> None:
        c.integers("count", c.state[COUNT], 0)
        c.finite("mean", c.state[MEAN])
        c.finite("m2", c.state[M2], 0.0)
'''

#: the same detector written the older way: a check per parameter, the metadata registered
HAND_CHECKED = DETECTOR.replace(
    "from ._params import Float, Int, arguments\n",
    "from .validation import check_float, check_int\n",
).replace(
    """    parameter_constraints = {"warmup": Int(2), "min_std": Float(0.0, low_open=True)}
    kind = "loss_spike"
    tuning_grid = {"warmup": (10, 30)}
    summary = "z-score against all past values."
""", """    hyperparameters = ("warmup", "min_std")
""").replace(
    """        super().__init__(**arguments(locals()))
""", """        super().__init__(n_series, threshold, freeze_on_alarm)
        name = type(self).__name__
        self.warmup = check_int(name, "warmup", warmup, 2)
        self.min_std = check_float(name, "min_std", min_std, 0.0, low_open=True)
        self._setup()
""")
assert HAND_CHECKED.count("check_int") == 2 and "arguments" not in HAND_CHECKED

#: file 3: tests/detectors/test_mean_z.py -- the naive reference and the test against it
REFERENCE_TEST = '''
import math

import numpy as np

from detectors import MeanZ


def ref_mean_z(x, threshold=6.0, warmup=10, min_std=1e-3, freeze_on_alarm=True):
    seen, out = [], []
    for v in x:
        if not math.isfinite(v):
            out.append(math.inf)
            continue
        s = 0.0
        if len(seen) >= max(warmup, 2):
            s = abs(v - np.mean(seen)) / max(np.std(seen, ddof=1), min_std)
        out.append(s)
        if not (s > threshold and freeze_on_alarm):
            seen.append(v)
    return np.array(out)


REFERENCES = {"mean_z": ref_mean_z}


def test_kernel_matches_the_reference():
    x = np.random.default_rng(0).normal(1.0, 0.1, 300)
    x[[100, 200]] = [5.0, np.nan]
    scores, _ = MeanZ().update_many(x)
    np.testing.assert_allclose(scores[:, 0], ref_mean_z(x), rtol=1e-9)
'''


@pytest.fixture(params=["declared", "hand_checked"])
def mean_z(request: pytest.FixtureRequest, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """Files 1 and 3 written, entry 2 registered; everything undone afterwards."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    source = DETECTOR if request.param == "declared" else HAND_CHECKED
    (pkg / "mean_z.py").write_text(textwrap.dedent(source), encoding="utf-8")
    (tmp_path / "test_mean_z.py").write_text(textwrap.dedent(REFERENCE_TEST), encoding="utf-8")
    monkeypatch.setattr(detectors, "__path__", [*detectors.__path__, str(pkg)])
    monkeypatch.setitem(REGISTRY, "mean_z", REGISTRY["ewma_z"])  # restored after the test
    # file 2: the registry line, as one line of stability/config/registry.py's BUILTIN says it
    if request.param == "declared":
        register_detector("mean_z", "detectors.mean_z:MeanZ")
    else:  # the metadata of a hand-checked class is given here
        register_detector("mean_z", "detectors.mean_z:MeanZ", kind="loss_spike",
                          grid={"warmup": (10, 30)}, doc="z-score against all past values.")
    spec = importlib.util.spec_from_file_location("test_mean_z", tmp_path / "test_mean_z.py")
    assert spec is not None and spec.loader is not None
    ref_test = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(ref_test)
        yield ref_test
    finally:
        sys.modules.pop("detectors.mean_z", None)
        registry._cache.pop("detectors.mean_z:MeanZ", None)


def test_a_new_detector_is_exported_usable_by_name_and_documented(mean_z: ModuleType) -> None:
    cls = detectors.MeanZ  # auto-exported: detectors/__init__.py was not edited
    assert cls.__module__ == "detectors.mean_z"
    mon = Monitor({"detectors": [{"name": "loss_mean_z", "detector": "mean_z",
                                  "inputs": ["loss"], "params": {"threshold": 5.0}}]},
                  alert_sinks=[])
    rng = np.random.default_rng(1)
    for s in range(60):
        assert mon.observe(s, {"loss": 2.0 + 0.01 * rng.standard_normal()}).healthy
    alarms = mon.observe(60, {"loss": 3.0}).alarms
    assert [(a.detector, a.kind) for a in alarms] == [("loss_mean_z", "loss_spike")]
    assert "| `mean_z` | `MeanZ` | z-score against all past values. |" in detectors_table()
    assert "| `mean_z` | `detectors.mean_z.MeanZ` | x | loss_spike | threshold × `warmup` 10, " \
           "30 |" in contracts_table()


def test_a_new_detector_is_tuned(mean_z: ModuleType) -> None:
    from replay.tuning import make_candidates

    assert tune_grids()["mean_z"] == {"warmup": [10, 30]}
    cands = make_candidates([{"name": "loss_mean_z", "detector": "mean_z", "inputs": ["loss"],
                              "params": {"threshold": 5.0}}])
    assert sorted(dict(c.params)["warmup"] for c in cands if c.sweepable) == [10, 30]


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_a_new_detector_passes_the_conformance_suite(mean_z: ModuleType, check: str) -> None:
    CHECKS[check]("mean_z")


def test_a_new_detector_has_its_reference_test(mean_z: ModuleType) -> None:
    check_reference("mean_z", mean_z)
    mean_z.test_kernel_matches_the_reference()
