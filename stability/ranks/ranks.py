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

The detector lives in :mod:`stability.ranks.outliers`, the ledger and its table in
:mod:`stability.ranks.health`; this module holds :class:`RankMonitor` and re-exports both.

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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from detectors.validation import param_error
from stability._state_check import Fields
from stability.ranks.health import RankHealthLedger, _ledger_args, format_ranks
from stability.ranks.outliers import (
    DEFAULT_SPECS,
    RANK_SIGNALS,
    STATE_VERSION,
    RankFinding,
    RankOutlierDetector,
    SignalSpec,
    _detector_args,
)
from stability.types import Alarm

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
        owner = "RankMonitor"
        names = [] if isinstance(hosts, (str, bytes)) else [str(h) for h in hosts]
        if not names:
            raise param_error(owner, "hosts", "a non-empty sequence of host names (one per rank)",
                              hosts)
        self.hosts = names
        # checked here too, so that errors name the class the user called
        _detector_args(owner, threshold, min_ranks, alpha)
        _ledger_args(owner, half_life, suspect_at)
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

    def observe(self, step: int, matrix: npt.ArrayLike,
                present: npt.ArrayLike | None = None) -> tuple[Alarm, ...]:
        """Score one step's ``(world, k)`` matrix; update the ledger; return the alarms.

        ``present``: one bool per rank, ``False`` for a rank whose row is missing this step
        (see :meth:`RankOutlierDetector.update`).
        """
        m = np.asarray(matrix, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != self.world_size:
            raise ValueError(f"Expected {self.world_size} rows (one per rank); got shape "
                             f"{m.shape}.")
        self.findings = self.detector.update(step, m, present)
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
        """Restore :meth:`state_dict` output (a bad snapshot raises and changes nothing)."""
        f = Fields("RankMonitor", sd)
        f.version(STATE_VERSION)
        before = self.detector.state_dict()
        self.detector.load_state_dict(f.mapping("detector", {}))
        try:
            if f.get("ledger", None) is not None:
                self.ledger.load_state_dict(f.mapping("ledger"))
        except ValueError:
            self.detector.load_state_dict(before)
            raise
