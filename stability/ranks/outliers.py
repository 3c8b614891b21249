"""Cross-rank outlier detection: each rank's local signals scored against the other ranks.

The detector half of :mod:`stability.ranks.ranks` (NumPy only; the scale and rules are described
there): :class:`RankOutlierDetector` turns one step's gathered ``(world, k)`` matrix into
:class:`RankFinding`\\ s, per signal compared as its :class:`SignalSpec` says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from detectors import MAD_SCALE
from detectors.validation import check_float, check_int
from stability._state_check import Fields

__all__ = ["DEFAULT_SPECS", "RANK_SIGNALS", "RankFinding", "RankOutlierDetector", "SignalSpec"]

#: Column order of the per-rank vector (``nonfinite`` is a 0/1 flag the rank raises itself).
RANK_SIGNALS = ("loss", "grad_norm", "step_time", "data_wait", "nonfinite")

#: Signals whose non-finite value on some ranks (only) names those ranks.
_NONFINITE_SOURCES = ("loss", "grad_norm")

STATE_VERSION = 1

#: E[(1.4826 MAD)^2] / sigma^2 for n = 3..32 normal values (simulated; ~1 beyond): the MAD of
#: a handful of ranks underestimates the spread, by 28% in variance for 4 ranks.
_MAD2_BIAS = (0.760, 0.717, 0.906, 0.867, 0.949, 0.918, 0.967, 0.947, 0.974, 0.960, 0.982,
              0.967, 0.986, 0.974, 0.986, 0.981, 0.991, 0.983, 0.989, 0.985, 0.991, 0.988,
              0.994, 0.989, 0.988, 0.989, 0.996, 0.994, 0.993, 0.992)


def _robust_var(v: np.ndarray) -> float:
    """Unbiased (for normal data) variance from the MAD of ``v`` (``len(v) >= 3``)."""
    med = float(np.median(v))
    mad = MAD_SCALE * float(np.median(np.abs(v - med)))
    n = v.size
    return mad * mad / (_MAD2_BIAS[n - 3] if n - 3 < len(_MAD2_BIAS) else 1.0)


@dataclass(frozen=True)
class SignalSpec:
    """How one signal is compared across ranks.

    Parameters
    ----------
    log : bool
        Compare ``log(x + offset)`` (ratios) instead of ``x``.
    offset : float
        Added before the log (ignores differences far below it, e.g. sub-ms data waits).
    floor : float
        Smallest scale, in transformed units (0.1 on a log signal: a 10% spread).
    rel_floor : float
        Linear signals only: the scale is at least ``rel_floor * |median|``.
    warmup : int
        Steps seen before this signal can name a rank (timings are noisy at start-up).
    two_sided : bool
        Flag values far below the others too (``False`` for times: being fast is no fault).
    persist : int
        Consecutive outlier steps of the same rank before it is named (``2`` for times: one slow
        step is jitter -- a pause, a page fault --, a straggler stays slow).
    """

    log: bool = False
    offset: float = 0.0
    floor: float = 1e-6
    rel_floor: float = 0.0
    warmup: int = 0
    two_sided: bool = True
    persist: int = 1


#: Default comparison per signal.
DEFAULT_SPECS: dict[str, SignalSpec] = {
    "loss": SignalSpec(log=False, floor=1e-3, rel_floor=0.05),
    "grad_norm": SignalSpec(log=True, offset=0.0, floor=0.05),
    "step_time": SignalSpec(log=True, offset=1e-3, floor=0.15, warmup=5, two_sided=False,
                            persist=2),
    "data_wait": SignalSpec(log=True, offset=1e-2, floor=0.15, warmup=5, two_sided=False,
                            persist=2),
}


@dataclass(frozen=True)
class RankFinding:
    """One rank flagged on one signal at one step (``z`` is ``inf`` for a non-finite value)."""

    step: int
    rank: int
    signal: str
    z: float
    value: float
    median: float


def _detector_args(owner: str, threshold: Any, min_ranks: Any, alpha: Any,
                   max_fraction: Any = 0.25, history: Any = 10
                   ) -> tuple[float, int, float, float, int]:
    """The checked arguments of :class:`RankOutlierDetector` (``owner`` names the class that
    was called, e.g. ``RankMonitor``, in the errors)."""
    return (check_float(owner, "threshold", threshold, 0.0, high_open=True),
            check_int(owner, "min_ranks", min_ranks, 3),
            check_float(owner, "alpha", alpha, 0.0, 1.0, high_open=True),
            check_float(owner, "max_fraction", max_fraction, 0.0, 1.0),
            check_int(owner, "history", history, 0))


def _present_mask(present: npt.ArrayLike | None, world: int) -> np.ndarray:
    """``present`` as a ``(world,)`` bool array (``None``: every rank)."""
    if present is None:
        return np.ones(world, dtype=bool)
    here = np.asarray(present, dtype=bool)
    if here.shape != (world,):
        raise ValueError(f"Expected one 'present' flag per rank ({world}); got shape "
                         f"{here.shape}.")
    return here


class RankOutlierDetector:
    """Per step, per signal: robust z of each rank against the cross-rank median.

    Parameters
    ----------
    threshold : float
        A rank is an outlier on a signal when ``|z| > threshold`` (``z > threshold`` for
        one-sided signals such as times).
    specs : mapping, optional
        :class:`SignalSpec` per signal name (default :data:`DEFAULT_SPECS`).
    min_ranks : int
        Finite values needed to name an outlier (the non-finite rule needs only one other rank).
    alpha : float
        Weight of the newest spread in the ``typical`` spread average.
    signals : sequence of str
        Column names of the matrices passed to :meth:`update` (default :data:`RANK_SIGNALS`).
    max_fraction : float
        A culprit is a minority: when more than ``max(1, max_fraction * n)`` ranks are outliers
        on one signal at once, the step is a global event and nobody is named.
    history : int
        Steps after which the scale comes from the ``typical`` spread alone (before, the
        current step's MAD counts too).

    Examples
    --------
    >>> import numpy as np
    >>> det = RankOutlierDetector()
    >>> x = np.array([[1.0, 2.0, 0.1, 0.0, 0.0]] * 4)
    >>> x[1, 0] = np.nan
    >>> [(f.rank, f.signal) for f in det.update(0, x)]
    [(1, 'nonfinite')]
    """

    def __init__(self, threshold: float = 6.0, specs: Mapping[str, SignalSpec] | None = None,
                 min_ranks: int = 3, alpha: float = 0.05,
                 signals: Sequence[str] = RANK_SIGNALS, max_fraction: float = 0.25,
                 history: int = 10) -> None:
        (self.threshold, self.min_ranks, self.alpha, self.max_fraction,
         self.history) = _detector_args("RankOutlierDetector", threshold, min_ranks, alpha,
                                        max_fraction, history)
        self.specs = dict(DEFAULT_SPECS if specs is None else specs)
        self.signals = tuple(signals)
        self.typical = {s: math.nan for s in self.specs}  #: EW cross-rank variance
        self.seen = {s: 0 for s in self.specs}  #: steps with enough finite values
        self.run: dict[str, list[int]] = {}  #: consecutive outlier steps per rank, by signal

    def reset(self) -> None:
        """Forget the typical spreads."""
        self.typical = {s: math.nan for s in self.specs}
        self.seen = {s: 0 for s in self.specs}
        self.run = {}

    def scores(self, name: str, values: npt.ArrayLike) -> tuple[np.ndarray, float, float]:
        """``(z per rank, median, scale)`` of one signal, *without* updating the state.

        ``z`` is ``nan`` where the value is not finite or too few ranks are finite.
        """
        spec = self.specs[name]
        x = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.log(x + spec.offset) if spec.log else x.copy()
        ok = np.isfinite(t)
        z = np.full(x.shape, np.nan)
        if int(ok.sum()) < self.min_ranks:
            return z, math.nan, math.nan
        v = t[ok]
        med = float(np.median(v))
        scale = max(spec.floor, spec.rel_floor * abs(med))
        typ = self.typical.get(name, math.nan)
        if math.isfinite(typ):
            scale = max(scale, math.sqrt(typ))
        if not math.isfinite(typ) or self.seen.get(name, 0) < self.history:
            scale = max(scale, MAD_SCALE * float(np.median(np.abs(v - med))))
        z[ok] = (v - med) / scale
        return z, med, scale

    def update(self, step: int, matrix: npt.ArrayLike,
               present: npt.ArrayLike | None = None) -> list[RankFinding]:
        """Score one step's ``(world, k)`` matrix (columns :attr:`signals`); test-then-train.

        ``present`` (optional, one bool per rank): ranks whose row is *missing* this step (a log
        that has not reached the step) are ``False``: they are neither judged nor part of the
        statistics, and their ``nan`` row is not a non-finite value.

        Returns the findings, ordered by rank then signal. All (present) ranks non-finite is
        *not* an attribution (the fault is everywhere already).
        """
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[1] != len(self.signals):
            raise ValueError(f"Expected a (world, {len(self.signals)}) matrix with columns "
                             f"{self.signals}; got shape {m.shape}.")
        here = _present_mask(present, m.shape[0])
        if not here.all():
            m = m.copy()
            m[~here] = np.nan
        col = {s: i for i, s in enumerate(self.signals)}
        out: list[RankFinding] = []
        # non-finite on some ranks only
        bad = np.zeros(m.shape[0], dtype=bool)
        for s in _NONFINITE_SOURCES:  # missing everywhere (nan on all ranks) is not a finding
            if s in col:
                b = ~np.isfinite(m[:, col[s]]) & here
                if not b[here].all():
                    bad |= b
        if "nonfinite" in col:
            flag = m[:, col["nonfinite"]]
            bad |= np.isfinite(flag) & (flag > 0)
        if bad.any() and not bad[here].all():
            for r in np.flatnonzero(bad):
                out.append(RankFinding(step, int(r), "nonfinite", math.inf, math.nan, math.nan))
        for s, spec in self.specs.items():
            if s not in col:
                continue
            x = m[:, col[s]].copy()
            x[bad] = np.nan  # a rank already named non-finite does not enter the statistics
            z, med, scale = self.scores(s, x)
            hit = np.isfinite(z) & ((np.abs(z) if spec.two_sided else z) > self.threshold)
            if int(hit.sum()) > max(1, int(self.max_fraction * np.isfinite(z).sum())):
                hit[:] = False  # a global event, not a culprit (and it trains the spread)
            run = self.run.setdefault(s, [0] * m.shape[0])
            if len(run) != m.shape[0]:
                run[:] = [0] * m.shape[0]
            for i in range(m.shape[0]):
                run[i] = run[i] + 1 if hit[i] else 0
            if not math.isfinite(med):
                continue
            if self.seen[s] >= spec.warmup:
                for r in np.flatnonzero(hit).tolist():
                    if run[r] < spec.persist:
                        continue
                    mval = math.exp(med) - spec.offset if spec.log else med
                    out.append(RankFinding(step, r, s, float(z[r]), float(x[r]), mval))
            self.seen[s] += 1
            with np.errstate(invalid="ignore", divide="ignore"):
                t = np.log(x + spec.offset) if spec.log else x
            var = _robust_var(t[np.isfinite(t)])  # one outlying rank does not move it
            if math.isfinite(var):
                typ = self.typical[s]
                self.typical[s] = var if not math.isfinite(typ) else (
                    (1.0 - self.alpha) * typ + self.alpha * var)
        out.sort(key=lambda f: (f.rank, f.signal))
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION,
                "typical": {k: (None if not math.isfinite(v) else v)
                            for k, v in self.typical.items()},
                "seen": dict(self.seen), "run": {k: list(v) for k, v in self.run.items()}}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked first: a bad snapshot changes nothing).

        Signals this detector does not compare are ignored; absent ones start afresh.
        """
        f = Fields("RankOutlierDetector", sd)
        f.version(STATE_VERSION)
        typ, seen, runs = f.sub("typical", {}), f.sub("seen", {}), f.sub("run", {})
        typical = {s: math.nan if typ.get(s, None) is None
                   else typ.number(s, lo=0.0, nan=True) for s in self.specs}
        counts = {s: seen.integer(s, seen.get(s, 0), lo=0) for s in self.specs}
        run = {s: [runs.integer(f"{s}[{i}]", x, lo=0) for i, x in enumerate(runs.seq(s))]
               for s in self.specs if runs.get(s, None) is not None}
        self.typical, self.seen, self.run = typical, counts, run
