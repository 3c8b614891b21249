"""Small banks of three features take the series-major loop: same bits as the layer loop.

``ActivationShift``'s kernel runs a batch of a small bank (a replay: a few layers, the
``default`` preset's three statistics) series by series in blocks of steps
(``_shift_series3``).  Its scores, alarms and state after every chunk must equal, bit for bit,
the layer-by-layer loop (``_shift_layers``, which every single step takes), the kernel's
interpreted twin, and a step-by-step run, on streams with missing, non-finite, zero,
negative and spiking values.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import pytest

from detectors import _shift_narrow
from detectors.activation import ActivationShift
from detectors.dispatch import interpreted

pytestmark = pytest.mark.skipif(bool(numba.config.DISABLE_JIT),
                                reason="no compiled kernels to compare the twins with")

N, T = 5, 600  # T spans several blocks of _shift_narrow.SERIES_BLOCK steps
CFGS: list[dict[str, Any]] = [
    {"n_features": 3, "log_space": [False, True, True], "warmup": 40, "threshold": 10.0},
    {"n_features": 3, "log_space": [False, True, True], "freeze_on_alarm": True,
     "threshold": 1.5, "warmup": 2, "alpha": 0.3},
    {"n_features": 3, "log_space": True, "aggregate": "max", "clip": math.inf, "warmup": 0,
     "threshold": 2.0, "min_scale": 0.0},
    {"n_features": 3, "log_space": False, "alpha": 0.5, "warmup": 1, "threshold": 3.0},
]


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype != np.float64:
        return a
    b = a.view(np.int64).copy()
    b[np.isnan(a)] = 0x7FF8000000000000
    return b


def _stream(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.2, (T, 3, N)))
    x[:, 0] -= 1.0  # a signed statistic
    x[rng.random(x.shape) < 0.03] *= 50.0
    x[T // 2, 1:] *= 40.0
    for value, p in ((np.nan, 0.01), (np.inf, 0.005), (-np.inf, 0.005), (0.0, 0.01),
                     (-1.0, 0.01)):
        x[rng.random(x.shape) < p] = value
    miss = rng.random(x.shape) < 0.05
    miss[T // 3: T // 3 + 5] = True
    miss[T // 4, :, 0] = True
    return np.ascontiguousarray(x), miss


def _run(kernel: Any, det: ActivationShift, x: np.ndarray, miss: np.ndarray,
         chunks: list[int], layers: bool = False) -> list[np.ndarray]:
    """Outputs and the state after every chunk of ``chunks`` steps."""
    state = det._state.copy()
    scores, alarms = np.empty((T, N)), np.empty((T, N), dtype=np.bool_)
    out = []
    t0 = 0
    with np.errstate(all="ignore"):
        for c in chunks:
            sl = slice(t0, t0 + c)
            if layers:
                kernel(x[sl], miss[sl], state, det._params_arr, scores[sl], alarms[sl],
                       np.empty(3))
            else:
                kernel(x[sl], miss[sl], state, det._buf, det._params_arr, scores[sl],
                       alarms[sl])
            out.append(state.copy())
            t0 += c
    return [scores, alarms, *out]


@pytest.mark.parametrize("case", range(len(CFGS)))
def test_series_major_loop_is_bit_identical(case: int) -> None:
    det = ActivationShift(n_series=N, **CFGS[case])
    x, miss = _stream(case)
    kernel = type(det).kernel
    chunks = [1, 299, 7, 256, 37]
    got = _run(kernel, det, x, miss, chunks)
    refs = [_run(_shift_narrow._shift_layers, det, x, miss, chunks, layers=True),
            _run(interpreted(kernel), det, x, miss, chunks),
            _run(kernel, det, x, miss, [1] * T)]
    for ref in refs:
        assert np.array_equal(_bits(got[0]), _bits(ref[0]))
        assert np.array_equal(got[1], ref[1])
        assert np.array_equal(got[-1], ref[-1])  # the state at the end
    for a, b in zip(got[2:], refs[0][2:], strict=True):  # and after every chunk
        assert np.array_equal(a, b)
    assert got[1].any() and not got[1].all()
    assert np.isnan(got[0]).any() and np.isinf(got[0]).any()
