"""A kernel fed a log row gives the same bits as the kernel taking its own logs.

``EWMAZScore`` (log space) and ``CoherentJump`` accept ``X`` of shape ``(T, 2, n)``: row 0
the values, row 1 ``log x`` wherever ``x > 0`` (the monitor's fused step computes it once and
shares it between the banks that read the same values).  Scores, alarms and state must be
bit-identical to the plain ``(T, 1, n)`` call -- compiled and interpreted, in every width path
(series by series, row by row, vectorised), for values at and around the log floor, zero,
negative, subnormal, NaN, +-inf and missing values -- whatever the row holds where ``x <= 0``.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import pytest

from detectors import CoherentJump, EWMAZScore
from detectors._base import LOG_FLOOR
from detectors.dispatch import interpreted

pytestmark = pytest.mark.skipif(bool(numba.config.DISABLE_JIT),
                                reason="no compiled kernels to compare the twins with")

#: the edge values of both kernels' log transforms (``max(x, 1e-30)`` and ``x > 0``)
EDGES = (LOG_FLOOR, math.nextafter(LOG_FLOOR, math.inf), math.nextafter(LOG_FLOOR, 0.0),
         1e-300, 5e-324, 2.2250738585072014e-308, 0.0, -0.0, -1.0, math.nan, math.inf,
         -math.inf, 1.0, 1e300)
DETECTORS: list[tuple[type, dict[str, Any]]] = [
    (EWMAZScore, {}),
    (EWMAZScore, {"direction": "both", "threshold": 2.0, "warmup": 3, "freeze_on_alarm": True}),
    (EWMAZScore, {"log_space": False, "threshold": 2.0, "warmup": 3}),  # the row is ignored
    (CoherentJump, {}),
    (CoherentJump, {"min_series": 1, "direction": "both", "threshold": 2.0, "warmup": 2}),
]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float64:
        return a
    b = a.view(np.int64).copy()
    b[np.isnan(a)] = 0x7FF8000000000000
    return b


def log_row(x: np.ndarray, elsewhere: float = 0.0) -> np.ndarray:
    """``(T, 2, n)``: ``x`` (``(T, 1, n)``) and ``math.log(x)`` where ``x > 0`` (the fused
    step's row; ``elsewhere`` where not)."""
    out = np.empty((x.shape[0], 2, x.shape[2]))
    out[:, 0] = x[:, 0]
    flat = x[:, 0].ravel()
    out[:, 1] = np.array([math.log(v) if v > 0.0 else elsewhere for v in flat.tolist()]
                         ).reshape(x.shape[0], x.shape[2])
    return out


def _stream(seed: int, t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0.0, 0.2, (t, 1, n)))
    x[rng.random(x.shape) < 0.03] *= 50.0
    x[t // 2, :, : max(2, n // 3)] *= 40.0  # a coherent jump
    edges = np.array(EDGES)
    hit = rng.random(x.shape) < 0.12
    x[hit] = edges[rng.integers(0, edges.size, int(hit.sum()))]
    x[3, 0, : edges.size] = edges[: min(n, edges.size)][: x[3, 0, : edges.size].size]
    miss = rng.random(x.shape) < 0.05
    return np.ascontiguousarray(x), miss


def _run(kernel: Any, det: Any, x: np.ndarray, miss: np.ndarray, step_by_step: bool
         ) -> tuple[np.ndarray, ...]:
    state, buf = det._state.copy(), det._buf.copy()
    t, n = x.shape[0], x.shape[2]
    scores, alarms = np.empty((t, n)), np.empty((t, n), dtype=np.bool_)
    with np.errstate(all="ignore"):
        if step_by_step:
            for s in range(t):
                kernel(x[s: s + 1], miss[s: s + 1], state, buf, det._params_arr,
                       scores[s: s + 1], alarms[s: s + 1])
        else:
            kernel(x, miss, state, buf, det._params_arr, scores, alarms)
    return scores, alarms, state, buf


@pytest.mark.parametrize("n", [5, 12, 40])  # series by series, row by row, vectorised
@pytest.mark.parametrize("case", range(len(DETECTORS)))
@pytest.mark.parametrize("step_by_step", [True, False])
def test_log_row_is_bit_identical(n: int, case: int, step_by_step: bool) -> None:
    cls, cfg = DETECTORS[case]
    det = cls(n_series=n, **cfg)
    assert det.uses_log_row() == cfg.get("log_space", True)
    x, miss = _stream(case + 10 * n, 120, n)
    kernel = type(det).kernel
    ref = _run(kernel, det, x, miss, step_by_step)
    for elsewhere in (0.0, math.nan, 123.0):  # the row is not read where x <= 0
        xl = log_row(x, elsewhere)
        for k in (kernel, interpreted(kernel)):
            got = _run(k, det, xl, miss, step_by_step)
            for what, a, b in zip(("scores", "alarms", "state", "buf"), got, ref, strict=True):
                assert np.array_equal(_bits(a), _bits(b)), f"{cls.__name__} {cfg} n={n}: {what}"
    assert ref[1].any() and not ref[1].all()  # both outcomes exercised


def test_other_banks_take_no_log_row() -> None:
    from stability.config.registry import REGISTRY, detector_class

    users = {name for name in REGISTRY if detector_class(name)().uses_log_row()}
    assert users == {"ewma_z", "coherent_jump"}
