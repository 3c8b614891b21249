"""The rules the industry uses today, scored on the same runs with the same evaluation.

Each baseline maps a recorded run (a wide table: ``step``, ``loss``, ``grad_norm``, ...) to a
boolean alarm per row.  They are built from this package's detectors with the parameter choices
that reproduce the rule (see each detector's docstring), so the comparison is about the rule,
not the implementation:

==================  ========================================================================
name                rule
==================  ========================================================================
``sigma6_128``      6 sigma over the last 128 values, on loss and grad norm:
                    ``RobustZScore(window=128, robust=False, threshold=6, log_space=False)``
``ratio2x_w100_p5`` loss >= 2x the mean of the last 100 values for 5 steps:
                    ``RatioToMean(window=100, threshold=2, patience=5, reference="mean")``
``max10x_first100`` loss >= 10x the max of the first 100 values:
                    ``RatioToMean(window=100, threshold=10, patience=1, reference="initial_max")``
``ratio3x_w10``     loss >= 3x the mean of the last 10 values:
                    ``RatioToMean(window=10, threshold=3, patience=1, reference="mean")``
``ema_z2.5``        EMA z-score > 2.5, EMA decay 0.97 (alpha 0.03), 25 warm-up steps, on loss
                    and grad norm (ZClip's rule): ``EWMAZScore(alpha=0.03, warmup=25,
                    threshold=2.5, log_space=False, debias=False, clip=inf)``
``nan_only``        stop on a non-finite loss only: ``NonFiniteGuard``
``page_hinkley``    ``river.drift.PageHinkley()`` defaults, on loss
``adwin``           ``river.drift.ADWIN()`` defaults, on loss
==================  ========================================================================

The ``>=`` rules use ``np.nextafter(threshold, 0)`` so that ``score > threshold`` reproduces
``>=`` exactly.  Like every detector here, the detector-based rules also alarm on a non-finite
value (which only makes the baselines stronger).  river's detectors cannot take NaN: non-finite
values are not fed to them (so they never alarm on NaN by themselves).  A signal a run does not
log (e.g. ``grad_norm`` in a loss-only log) is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from detectors import BankDetector, EWMAZScore, NonFiniteGuard

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
#: column name -> (values float64 with nan for nulls, missing mask)
Columns = Mapping[str, tuple[FloatArray, BoolArray]]


def column(table: pa.Table, name: str) -> tuple[FloatArray, BoolArray] | None:
    """A table column as ``(values, missing)`` float64/bool arrays (``None`` if absent).

    >>> t = pa.table({"loss": pa.array([1.0, None, float("nan")])})
    >>> v, m = column(t, "loss")
    >>> m.tolist(), bool(np.isnan(v[2]))
    ([False, True, False], True)
    """
    if name not in table.column_names:
        return None
    col = table.column(name).cast(pa.float64())
    miss = pc.is_null(col).to_numpy(zero_copy_only=False).astype(np.bool_)
    vals = col.to_numpy(zero_copy_only=False).astype(np.float64)
    return np.ascontiguousarray(vals), np.ascontiguousarray(miss)


def _ge(t: float) -> float:
    return float(np.nextafter(t, 0.0))


def _robust(**kw: object) -> BankDetector:
    from detectors.robust import RobustZScore

    return RobustZScore(**kw)  # type: ignore[arg-type]


def _ratio(**kw: object) -> BankDetector:
    from detectors.ratio import RatioToMean

    return RatioToMean(**kw)  # type: ignore[arg-type]


def _detector_rule(factory: Callable[[int], BankDetector],
                   signals: tuple[str, ...]) -> Callable[[Columns, int], BoolArray]:
    def rule(cols: Columns, n_rows: int) -> BoolArray:
        present = [s for s in signals if s in cols]
        out = np.zeros(n_rows, dtype=np.bool_)
        if not present or n_rows == 0:
            return out
        det = factory(len(present))
        x = np.stack([cols[s][0] for s in present], axis=1)
        m = np.stack([cols[s][1] for s in present], axis=1)
        _, alarms = det.update_many(x, missing=m)
        return np.asarray(alarms.any(axis=1))

    return rule


def _river_rule(make: Callable[[], object]) -> Callable[[Columns, int], BoolArray]:
    def rule(cols: Columns, n_rows: int) -> BoolArray:
        out = np.zeros(n_rows, dtype=np.bool_)
        if "loss" not in cols:
            return out
        vals, miss = cols["loss"]
        det = make()
        ok = ~miss & np.isfinite(vals)
        for i in np.flatnonzero(ok):
            det.update(float(vals[i]))  # type: ignore[attr-defined]
            if det.drift_detected:  # type: ignore[attr-defined]
                out[i] = True
        return out

    return rule


def _page_hinkley() -> object:
    from river.drift import PageHinkley

    return PageHinkley()


def _adwin() -> object:
    from river.drift import ADWIN

    return ADWIN()


@dataclass(frozen=True)
class Baseline:
    """A named industry rule: ``rule(columns, n_rows) -> alarm per row``."""

    name: str
    description: str
    rule: Callable[[Columns, int], BoolArray]
    signals: tuple[str, ...] = ("loss",)


LOSS_GRAD = ("loss", "grad_norm")

BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("sigma6_128", "6 sigma over the last 128 values (loss, grad norm)",
             _detector_rule(lambda n: _robust(n_series=n, window=128, robust=False,
                                              threshold=6.0, log_space=False), LOSS_GRAD),
             LOSS_GRAD),
    Baseline("ratio2x_w100_p5", "loss >= 2x the 100-step mean for 5 steps",
             _detector_rule(lambda n: _ratio(n_series=n, window=100, threshold=_ge(2.0),
                                             patience=5, reference="mean"), ("loss",))),
    Baseline("max10x_first100", "loss >= 10x the max of the first 100 values",
             _detector_rule(lambda n: _ratio(n_series=n, window=100, threshold=_ge(10.0),
                                             patience=1, reference="initial_max"), ("loss",))),
    Baseline("ratio3x_w10", "loss >= 3x the 10-step mean",
             _detector_rule(lambda n: _ratio(n_series=n, window=10, threshold=_ge(3.0),
                                             patience=1, reference="mean"), ("loss",))),
    Baseline("ema_z2.5", "EMA(0.97) z-score > 2.5 after 25 steps (loss, grad norm)",
             _detector_rule(lambda n: EWMAZScore(n_series=n, alpha=0.03, warmup=25,
                                                 threshold=2.5, log_space=False, debias=False,
                                                 clip=float("inf")), LOSS_GRAD),
             LOSS_GRAD),
    Baseline("nan_only", "stop on a non-finite loss only",
             _detector_rule(lambda n: NonFiniteGuard(n_series=n), ("loss",))),
    Baseline("page_hinkley", "river PageHinkley() defaults on loss", _river_rule(_page_hinkley)),
    Baseline("adwin", "river ADWIN() defaults on loss", _river_rule(_adwin)),
)}


def columns_of(table: pa.Table, signals: tuple[str, ...] = LOSS_GRAD) -> dict[str,
                                                                              tuple[FloatArray,
                                                                                    BoolArray]]:
    """Extract the given signals of a run (absent ones are left out)."""
    out = {}
    for s in signals:
        c = column(table, s)
        if c is not None:
            out[s] = c
    return out


def baseline_alarms(table: pa.Table, names: list[str] | None = None) -> dict[str, NDArray[
        np.int64]]:
    """Alarm *steps* of each baseline on one run.

    Parameters
    ----------
    table
        A wide run table with a ``step`` column.
    names
        Baselines to run (default: all of :data:`BASELINES`).

    Examples
    --------
    >>> loss = np.full(300, 2.0)
    >>> loss[250] = 50.0
    >>> t = pa.table({"step": np.arange(300), "loss": loss})
    >>> out = baseline_alarms(t, ["ratio3x_w10", "max10x_first100", "nan_only"])
    >>> {k: v.tolist() for k, v in out.items()}
    {'ratio3x_w10': [250], 'max10x_first100': [250], 'nan_only': []}
    """
    names = list(BASELINES) if names is None else names
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; known: {sorted(BASELINES)}")
    steps = table.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    cols = columns_of(table)
    n = table.num_rows
    return {name: steps[BASELINES[name].rule(cols, n)] for name in names}
