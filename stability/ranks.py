"""Which rank is the culprit: cross-rank outlier detection and a machine-health ledger.

Every step each rank contributes a small vector of *local* signals -- its own loss, its gradient
norm *before* the all-reduce, its busy time, its data-wait time, a non-finite flag -- and the
adapter (:mod:`stability.adapters.distributed`) gathers them into a ``(world, k)`` matrix that is
identical on every rank. This module is the framework-free part (NumPy only):

* :class:`RankOutlierDetector` scores each rank against the others, per step and per signal, with
  a robust z (distance to the cross-rank median in units of a robust scale) and names the rank
  whose value is non-finite while others are finite;
* :class:`RankHealthLedger` accumulates per-rank suspicion over time (decaying counts of outlier
  steps by signal); a rank whose count reaches ``suspect_at`` becomes a *suspect*, with evidence;
* :class:`RankMonitor` ties both together, turns findings into :class:`~stability.types.Alarm`\\ s
  that name the rank and its host, and exports ``{"type": "rank_health", ...}`` event records;
* :func:`format_ranks` renders those records as a table (``stability ranks EVENTS``).

Alarms: ``kind="rank_outlier"``, ``detector="rank_mad"``, ``signal="rank<r>/<signal>"`` (the
rank is in the signal name, so alarms stay plain data), ``message`` such as
``"grad_norm outlier on rank 3 / host-b: 41.0 sigma"``. Everything here is deterministic and fed
only gathered data, so every rank reaches the same alarms at the same step.

Scale: per signal the values are transformed (``log(x + offset)`` for positive, multiplicative
signals: gradient norm and times; linear for the loss), and
``z = (x_r - median) / max(floor, typical)`` where ``typical`` is the root of an exponential
moving average of each step's MAD-based variance (corrected for the MAD's small-sample bias: with
4 ranks it underestimates the variance by 28%). The MAD ignores one outlying rank, so neither a
fault nor a straggler inflates the scale it is judged by. During the first ``history`` steps the
current MAD counts too. At most a minority of ranks (``max_fraction``) can be named on one signal
at one step -- more is a global event, not a culprit. At least ``min_ranks`` (3) finite
values are needed to name an outlier; with two ranks only the non-finite rule applies.

Examples
--------
>>> import numpy as np
>>> mon = RankMonitor(hosts=["a", "a", "b", "b"])
>>> x = np.array([[2.0, 1.0, 0.1, 0.0, 0.0]] * 4)
>>> x[3, 1] = 40.0                                 # rank 3's local gradient norm
>>> [a.message for a in mon.observe(7, x)]
['grad_norm outlier on rank 3 / b: 73.8 sigma']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from detectors import MAD_SCALE

from .types import Alarm

__all__ = [
    "RANK_SIGNALS",
    "SignalSpec",
    "DEFAULT_SPECS",
    "RankFinding",
    "RankOutlierDetector",
    "RankHealthLedger",
    "RankMonitor",
    "format_ranks",
]

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


def _check(name: str, cls: str, v: float, lo: float, hi: float = math.inf,
           integer: bool = False, closed: bool = False) -> None:
    ok = (isinstance(v, (int, np.integer)) if integer else isinstance(v, (int, float))) and (
        lo <= v and (v <= hi if closed else v < hi or hi == math.inf))
    if not ok or (not integer and not math.isfinite(float(v))):
        kind = "an int" if integer else "a float"
        raise ValueError(f"The {name!r} parameter of {cls} must be {kind} in the range "
                         f"[{lo}, {hi}{']' if closed else ')'}. Got {v!r} instead.")


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
        _check("threshold", "RankOutlierDetector", threshold, 0.0)
        _check("max_fraction", "RankOutlierDetector", max_fraction, 0.0, 1.0, closed=True)
        _check("history", "RankOutlierDetector", history, 0, integer=True)
        self.max_fraction = float(max_fraction)
        self.history = int(history)
        _check("min_ranks", "RankOutlierDetector", min_ranks, 3, integer=True)
        _check("alpha", "RankOutlierDetector", alpha, 0.0, 1.0)
        self.threshold = float(threshold)
        self.specs = dict(DEFAULT_SPECS if specs is None else specs)
        self.min_ranks = int(min_ranks)
        self.alpha = float(alpha)
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

    def update(self, step: int, matrix: npt.ArrayLike) -> list[RankFinding]:
        """Score one step's ``(world, k)`` matrix (columns :attr:`signals`); test-then-train.

        Returns the findings, ordered by rank then signal. All ranks non-finite is *not* an
        attribution (the fault is everywhere already).
        """
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[1] != len(self.signals):
            raise ValueError(f"Expected a (world, {len(self.signals)}) matrix with columns "
                             f"{self.signals}; got shape {m.shape}.")
        col = {s: i for i, s in enumerate(self.signals)}
        out: list[RankFinding] = []
        # non-finite on some ranks only
        bad = np.zeros(m.shape[0], dtype=bool)
        for s in _NONFINITE_SOURCES:  # missing everywhere (nan on all ranks) is not a finding
            if s in col:
                b = ~np.isfinite(m[:, col[s]])
                if not b.all():
                    bad |= b
        if "nonfinite" in col:
            flag = m[:, col["nonfinite"]]
            bad |= np.isfinite(flag) & (flag > 0)
        if bad.any() and not bad.all():
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
        """Restore :meth:`state_dict` output."""
        self.reset()
        for k, v in sd.get("typical", {}).items():
            if k in self.typical:
                self.typical[k] = math.nan if v is None else float(v)
        for k, v in sd.get("seen", {}).items():
            if k in self.seen:
                self.seen[k] = int(v)
        self.run = {str(k): [int(x) for x in v] for k, v in sd.get("run", {}).items()}


class RankHealthLedger:
    """Per-rank suspicion over time: decaying counts of outlier steps, by signal.

    Parameters
    ----------
    world_size : int
        Number of ranks.
    hosts : sequence of str, optional
        Host name of each rank.
    half_life : float
        Steps after which an outlier step counts half.
    suspect_at : float
        Decayed outlier-step count at which a rank becomes a suspect. The default ``2.5`` takes
        three outlier steps within about a quarter of ``half_life`` (or more, spread wider); a
        single step never suffices. A rank stays a suspect until its count decays below half.
    keep_steps : int
        Most recent outlier steps kept as evidence per rank.

    Examples
    --------
    >>> led = RankHealthLedger(4, hosts=["a", "a", "b", "b"], suspect_at=1.5)
    >>> led.update(10, [RankFinding(10, 2, "grad_norm", 30.0, 9.0, 1.0)])
    []
    >>> [r["rank"] for r in led.update(11, [RankFinding(11, 2, "loss", 8.0, 9.0, 1.0)])]
    [2]
    >>> led.suspects()
    [2]
    """

    def __init__(self, world_size: int, hosts: Sequence[str] | None = None,
                 half_life: float = 200.0, suspect_at: float = 2.5,
                 keep_steps: int = 20) -> None:
        _check("world_size", "RankHealthLedger", world_size, 1, integer=True)
        _check("half_life", "RankHealthLedger", half_life, 1e-9)
        _check("suspect_at", "RankHealthLedger", suspect_at, 1e-9)
        _check("keep_steps", "RankHealthLedger", keep_steps, 0, integer=True)
        self.world_size = int(world_size)
        self.hosts = list(hosts) if hosts is not None else [""] * self.world_size
        if len(self.hosts) != self.world_size:
            raise ValueError(f"Got {len(self.hosts)} hosts for {self.world_size} ranks.")
        self.half_life = float(half_life)
        self.suspect_at = float(suspect_at)
        self.keep_steps = int(keep_steps)
        self.reset()

    def reset(self) -> None:
        """Forget all history."""
        n = self.world_size
        self.score = [0.0] * n  #: decayed outlier-step count, as of ``self.at[r]``
        self.at = [0] * n
        self.outlier_steps = [0] * n
        self.by_signal: list[dict[str, int]] = [{} for _ in range(n)]
        self.peak_z = [0.0] * n
        self.peak_signal = [""] * n
        self.first_step: list[int | None] = [None] * n
        self.recent: list[list[int]] = [[] for _ in range(n)]
        self.suspect = [False] * n
        self.suspect_since: list[int | None] = [None] * n

    def suspicion(self, rank: int, step: int) -> float:
        """Decayed outlier-step count of ``rank`` at ``step``."""
        dt = max(step - self.at[rank], 0)
        return self.score[rank] * 0.5 ** (dt / self.half_life)

    def update(self, step: int, findings: Iterable[RankFinding]) -> list[dict[str, Any]]:
        """Add one step's findings; return the records of ranks whose status changed."""
        per_rank: dict[int, list[RankFinding]] = {}
        for f in findings:
            if 0 <= f.rank < self.world_size:
                per_rank.setdefault(f.rank, []).append(f)
        changed: list[dict[str, Any]] = []
        for r, fs in sorted(per_rank.items()):
            self.score[r] = self.suspicion(r, step) + 1.0
            self.at[r] = step
            self.outlier_steps[r] += 1
            if self.first_step[r] is None:
                self.first_step[r] = step
            for f in fs:
                self.by_signal[r][f.signal] = self.by_signal[r].get(f.signal, 0) + 1
                if abs(f.z) > abs(self.peak_z[r]):
                    self.peak_z[r], self.peak_signal[r] = f.z, f.signal
            if self.keep_steps:
                self.recent[r] = (self.recent[r] + [step])[-self.keep_steps:]
        for r in range(self.world_size):
            s = self.suspicion(r, step)
            if not self.suspect[r] and s >= self.suspect_at:
                self.suspect[r], self.suspect_since[r] = True, step
                changed.append(self.record(r, step))
            elif self.suspect[r] and s < 0.5 * self.suspect_at:
                self.suspect[r], self.suspect_since[r] = False, None
                changed.append(self.record(r, step))
        return changed

    def suspects(self) -> list[int]:
        """Ranks currently suspected."""
        return [r for r in range(self.world_size) if self.suspect[r]]

    def record(self, rank: int, step: int) -> dict[str, Any]:
        """The ``{"type": "rank_health", ...}`` event record of one rank."""
        return {
            "type": "rank_health", "step": int(step), "rank": rank, "host": self.hosts[rank],
            "status": "suspect" if self.suspect[rank] else "ok",
            "suspicion": round(self.suspicion(rank, step), 6),
            "outlier_steps": self.outlier_steps[rank],
            "signals": dict(sorted(self.by_signal[rank].items())),
            "peak_z": self.peak_z[rank], "peak_signal": self.peak_signal[rank],
            "first_step": self.first_step[rank], "suspect_since": self.suspect_since[rank],
            "recent_steps": list(self.recent[rank]),
        }

    def records(self, step: int, all_ranks: bool = False) -> list[dict[str, Any]]:
        """Records of every rank with any outlier history (of all ranks with ``all_ranks``)."""
        return [self.record(r, step) for r in range(self.world_size)
                if all_ranks or self.outlier_steps[r]]

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION, "hosts": list(self.hosts), "score": list(self.score),
                "at": list(self.at), "outlier_steps": list(self.outlier_steps),
                "by_signal": [dict(d) for d in self.by_signal],
                "peak_z": [v if math.isfinite(v) else "inf" for v in self.peak_z],
                "peak_signal": list(self.peak_signal), "first_step": list(self.first_step),
                "recent": [list(x) for x in self.recent], "suspect": list(self.suspect),
                "suspect_since": list(self.suspect_since)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the world size must match)."""
        if len(sd.get("score", [])) != self.world_size:
            raise ValueError(f"State for {len(sd.get('score', []))} ranks; this ledger has "
                             f"{self.world_size}.")
        self.reset()
        self.hosts = [str(h) for h in sd.get("hosts", self.hosts)]
        self.score = [float(v) for v in sd["score"]]
        self.at = [int(v) for v in sd.get("at", self.at)]
        self.outlier_steps = [int(v) for v in sd.get("outlier_steps", self.outlier_steps)]
        self.by_signal = [{str(k): int(v) for k, v in d.items()}
                          for d in sd.get("by_signal", self.by_signal)]
        self.peak_z = [float(v) for v in sd.get("peak_z", self.peak_z)]
        self.peak_signal = [str(v) for v in sd.get("peak_signal", self.peak_signal)]
        self.first_step = [None if v is None else int(v)
                           for v in sd.get("first_step", self.first_step)]
        self.recent = [[int(s) for s in x] for x in sd.get("recent", self.recent)]
        self.suspect = [bool(v) for v in sd.get("suspect", self.suspect)]
        self.suspect_since = [None if v is None else int(v)
                              for v in sd.get("suspect_since", self.suspect_since)]


class RankMonitor:
    """Detector + ledger: gathered per-rank matrix in, alarms naming rank and host out.

    Parameters
    ----------
    hosts : sequence of str
        Host name of each rank (its length is the world size).
    threshold, specs, min_ranks, alpha, signals
        See :class:`RankOutlierDetector`.
    half_life, suspect_at
        See :class:`RankHealthLedger`.
    critical : sequence of str
        Signals whose outliers are ``critical`` (the rest are ``warning``): corruption of the
        gradient or loss, and non-finite values.
    """

    def __init__(self, hosts: Sequence[str], threshold: float = 6.0,
                 specs: Mapping[str, SignalSpec] | None = None, min_ranks: int = 3,
                 alpha: float = 0.05, signals: Sequence[str] = RANK_SIGNALS,
                 half_life: float = 200.0, suspect_at: float = 2.5,
                 critical: Sequence[str] = ("nonfinite", "grad_norm", "loss")) -> None:
        self.hosts = [str(h) for h in hosts]
        self.detector = RankOutlierDetector(threshold, specs, min_ranks, alpha, signals)
        self.ledger = RankHealthLedger(len(self.hosts), self.hosts, half_life, suspect_at)
        self.critical = tuple(critical)
        self.findings: list[RankFinding] = []  #: this step's findings
        self.changes: list[dict[str, Any]] = []  #: ledger records whose status changed this step

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def where(self, rank: int) -> str:
        """``"rank 3 / host-b"`` (``"rank 3"`` without a host name)."""
        h = self.hosts[rank] if 0 <= rank < len(self.hosts) else ""
        return f"rank {rank} / {h}" if h else f"rank {rank}"

    def alarm(self, f: RankFinding) -> Alarm:
        """The :class:`Alarm` of one finding."""
        if f.signal == "nonfinite":
            msg = f"non-finite loss or gradient on {self.where(f.rank)} only"
        else:
            msg = f"{f.signal} outlier on {self.where(f.rank)}: {abs(f.z):.1f} sigma"
        sev = "critical" if f.signal in self.critical else "warning"
        return Alarm(f.step, "rank_outlier", f"rank{f.rank}/{f.signal}", float(abs(f.z)),
                     self.detector.threshold, sev, "rank_mad", msg)

    def observe(self, step: int, matrix: npt.ArrayLike) -> tuple[Alarm, ...]:
        """Score one step's ``(world, k)`` matrix; update the ledger; return the alarms."""
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != self.world_size:
            raise ValueError(f"Expected {self.world_size} rows (one per rank); got shape "
                             f"{m.shape}.")
        self.findings = self.detector.update(step, m)
        self.changes = self.ledger.update(step, self.findings)
        return tuple(self.alarm(f) for f in self.findings)

    def records(self, step: int, all_ranks: bool = False) -> list[dict[str, Any]]:
        """``rank_health`` event records (see :meth:`RankHealthLedger.records`)."""
        return self.ledger.records(step, all_ranks)

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state with a ``"version"`` key."""
        return {"version": STATE_VERSION, "detector": self.detector.state_dict(),
                "ledger": self.ledger.state_dict()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.detector.load_state_dict(sd.get("detector", {}))
        if "ledger" in sd:
            self.ledger.load_state_dict(sd["ledger"])


def format_ranks(records: Iterable[Mapping[str, Any]]) -> str:
    """A table of the latest ``rank_health`` record per rank, plus rank-outlier alarm counts.

    ``records`` are event-log records of any type (others are ignored), oldest first.

    Examples
    --------
    >>> recs = [{"type": "alarm", "step": 5, "kind": "rank_outlier",
    ...          "signal": "rank1/grad_norm", "score": 40.0},
    ...         {"type": "rank_health", "step": 9, "rank": 1, "host": "b", "status": "suspect",
    ...          "suspicion": 3.0, "outlier_steps": 3, "signals": {"grad_norm": 3},
    ...          "peak_z": 40.0, "peak_signal": "grad_norm", "recent_steps": [5, 7, 9]}]
    >>> print(format_ranks(recs))
    rank  host  status   suspicion  outlier steps  peak z  signals      recent steps
       1  b     suspect       3.00              3    40.0  grad_norm:3  5 7 9
    1 rank-outlier alarm(s); suspects: rank 1 / b
    """
    latest: dict[int, Mapping[str, Any]] = {}
    alarms: dict[int, int] = {}
    for rec in records:
        t = rec.get("type")
        if t == "rank_health":
            latest[int(rec["rank"])] = rec
        elif t == "alarm" and rec.get("kind") == "rank_outlier":
            sig = str(rec.get("signal", ""))
            head = sig.split("/", 1)[0]
            if head.startswith("rank") and head[4:].isdigit():
                alarms[int(head[4:])] = alarms.get(int(head[4:]), 0) + 1
    if not latest and not alarms:
        return "no rank-health records: every rank looked like the others"
    rows = [("rank", "host", "status", "suspicion", "outlier steps", "peak z", "signals",
             "recent steps")]
    for r in sorted(set(latest) | set(alarms)):
        rec = latest.get(r, {})
        counts: Mapping[str, Any] = rec.get("signals", {}) or {}
        pz = rec.get("peak_z")
        rows.append((
            str(r), str(rec.get("host", "")), str(rec.get("status", "ok")),
            f"{float(rec.get('suspicion', 0.0)):.2f}",
            str(rec.get("outlier_steps", alarms.get(r, 0))),
            "-" if pz is None else f"{float(pz):.1f}",
            " ".join(f"{k}:{v}" for k, v in counts.items()) or "-",
            " ".join(str(s) for s in rec.get("recent_steps", [])[-8:]) or "-",
        ))
    right = {0, 3, 4, 5}
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
             for row in rows]
    sus = [f"rank {r}" + (f" / {latest[r].get('host')}" if latest[r].get("host") else "")
           for r in sorted(latest) if latest[r].get("status") == "suspect"]
    lines.append(f"{sum(alarms.values())} rank-outlier alarm(s); suspects: "
                 + (", ".join(sus) if sus else "none"))
    return "\n".join(lines)
