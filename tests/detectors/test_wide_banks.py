"""Wide banks (the monitor's per-layer banks) take vectorised paths: same bits as the narrow ones.

``EWMAZScore``, ``CoherentJump`` (``VECTOR_FROM``) and ``ActivationShift``
(``FEATURE_MAJOR_FROM``) update banks of many series in branch-free loops over all series
and keep their series-by-series loops for small banks.  Both must give bit-identical
scores, alarms and state: checked here by running the compiled kernel on a wide bank
against its interpreted twin with the width threshold raised out of reach (the narrow loop,
in plain Python) and against its plain twin (the wide loop, in plain Python), on streams with
missing, non-finite, zero, negative and spiking values, step by step and in one batch.
"""

from __future__ import annotations

import math
import types
from typing import Any

import numba
import numpy as np
import pytest

from detectors import activation, ewma, jump
from detectors.dispatch import interpreted

pytestmark = pytest.mark.skipif(bool(numba.config.DISABLE_JIT),
                                reason="no compiled kernels to compare the twins with")

N = 40  # above every width threshold
CASES: list[tuple[Any, str, dict[str, Any]]] = [
    (ewma, "VECTOR_FROM", {}),
    (ewma, "VECTOR_FROM", {"log_space": False, "direction": "both", "freeze_on_alarm": True,
                           "threshold": 2.0, "warmup": 3}),
    (ewma, "VECTOR_FROM", {"direction": "down", "clip": math.inf, "debias": False,
                           "min_std": 0.0, "threshold": 1.0}),
    (jump, "VECTOR_FROM", {}),
    (jump, "VECTOR_FROM", {"min_series": 3, "direction": "both", "freeze_on_alarm": True,
                           "threshold": 2.0, "warmup": 2, "alpha": 0.3}),
    (jump, "VECTOR_FROM", {"min_series": 1, "direction": "down", "clip": math.inf,
                           "level_alpha": 0.0, "warmup": 0, "threshold": 1.0}),
    (activation, "FEATURE_MAJOR_FROM", {}),
    (activation, "FEATURE_MAJOR_FROM", {"n_features": 3, "log_space": [False, True, True],
                                        "freeze_on_alarm": True, "threshold": 1.5,
                                        "warmup": 2, "alpha": 0.3}),
    (activation, "FEATURE_MAJOR_FROM", {"n_features": 2, "log_space": True, "aggregate": "max",
                                        "clip": math.inf, "warmup": 0, "threshold": 2.0}),
]
CLASSES = {ewma: "EWMAZScore", jump: "CoherentJump", activation: "ActivationShift"}


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float64:
        return a
    b = a.view(np.int64).copy()
    b[np.isnan(a)] = 0x7FF8000000000000
    return b


def _stream(seed: int, t: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.2, (t, n_in, N)))
    x[:, 0, : N // 2] -= 1.0  # signed values in half of the series
    x[rng.random(x.shape) < 0.03] *= 50.0
    x[t // 2, :, : N // 3] *= 40.0  # a coherent jump
    for value, p in ((np.nan, 0.01), (np.inf, 0.005), (-np.inf, 0.005), (0.0, 0.01),
                     (-1.0, 0.01)):
        x[rng.random(x.shape) < p] = value
    miss = rng.random(x.shape) < 0.05
    miss[t // 3: t // 3 + 5] = True
    return np.ascontiguousarray(x), miss


def _narrow_twin(module: Any, constant: str) -> Any:
    """The kernel's interpreted twin with the width threshold out of reach (narrow loops)."""
    twin = interpreted(module._kernel if module is not activation else module._shift_kernel)
    glb = dict(twin.__globals__)
    glb[constant] = 10**9
    return types.FunctionType(twin.__code__, glb, twin.__name__, twin.__defaults__,
                              twin.__closure__)


def _run(kernel: Any, det: Any, x: np.ndarray, miss: np.ndarray, step_by_step: bool
         ) -> tuple[np.ndarray, ...]:
    state, buf = det._state.copy(), det._buf.copy()
    t = x.shape[0]
    scores, alarms = np.empty((t, N)), np.empty((t, N), dtype=np.bool_)
    with np.errstate(all="ignore"):
        if step_by_step:
            for s in range(t):
                kernel(x[s: s + 1], miss[s: s + 1], state, buf, det._params_arr,
                       scores[s: s + 1], alarms[s: s + 1])
        else:
            kernel(x, miss, state, buf, det._params_arr, scores, alarms)
    return scores, alarms, state, buf


@pytest.mark.parametrize(("case", "step_by_step"), [(c, s) for c in range(len(CASES))
                                                    for s in (False, True)])
def test_wide_bank_is_bit_identical_to_narrow_loops(case: int, step_by_step: bool) -> None:
    module, constant, cfg = CASES[case]
    assert N >= getattr(module, constant)
    det = getattr(module, CLASSES[module])(n_series=N, **cfg)
    x, miss = _stream(case, 160, det.n_inputs)
    kernel = type(det).kernel
    wide = _run(kernel, det, x, miss, step_by_step)
    for other in (_narrow_twin(module, constant), interpreted(kernel)):
        ref = _run(other, det, x, miss, step_by_step)
        for what, a, b in zip(("scores", "alarms", "state", "buf"), wide, ref, strict=True):
            assert np.array_equal(_bits(a), _bits(b)), f"{CLASSES[module]} {cfg}: {what}"
    assert wide[1].any() and not wide[1].all()  # both outcomes exercised
