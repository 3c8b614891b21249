"""Per-rank health over time: a decaying suspicion ledger and its ``rank_health`` table.

:class:`RankHealthLedger` accumulates the :class:`~stability.ranks.outliers.RankFinding`\\ s of
:class:`~stability.ranks.outliers.RankOutlierDetector` into per-rank suspicion (decaying counts of
outlier steps by signal) and exports ``{"type": "rank_health", ...}`` event records;
:func:`format_ranks` renders those records (``stability ranks EVENTS``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from detectors.validation import as_bool, check_float, check_int, param_error
from stability._state_check import Fields
from stability.ranks.outliers import STATE_VERSION, RankFinding

__all__ = ["RankHealthLedger", "format_ranks"]


def _ledger_args(owner: str, half_life: Any, suspect_at: Any,
                 keep_steps: Any = 20) -> tuple[float, float, int]:
    """The checked arguments of :class:`RankHealthLedger` (``owner``: the class called)."""
    return (check_float(owner, "half_life", half_life, 1e-9, high_open=True),
            check_float(owner, "suspect_at", suspect_at, 1e-9, high_open=True),
            check_int(owner, "keep_steps", keep_steps, 0))


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
        owner = "RankHealthLedger"
        self.world_size = check_int(owner, "world_size", world_size, 1)
        self.half_life, self.suspect_at, self.keep_steps = _ledger_args(
            owner, half_life, suspect_at, keep_steps)
        self.hosts = [str(h) for h in hosts] if hosts is not None else [""] * self.world_size
        if len(self.hosts) != self.world_size or isinstance(hosts, (str, bytes)):
            raise param_error(owner, "hosts", f"None or a sequence of {self.world_size} host "
                              "names (one per rank)", hosts)
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
        """Restore :meth:`state_dict` output (the world size must match; checked first: a bad
        snapshot changes nothing)."""
        f = Fields("RankHealthLedger", sd)
        f.version(STATE_VERSION)
        n = self.world_size

        def per_rank(key: str, read: Any, default: list[Any] | None = None) -> list[Any]:
            if default is not None and f.get(key, None) is None:
                return list(default)
            return [read(f"{key}[{r}]", v) for r, v in enumerate(f.seq(key, n))]

        def opt_step(k: str, v: Any) -> int | None:
            return f.opt_integer(k, v)

        def signals(k: str, v: Any) -> dict[str, int]:
            d = Fields(f.owner, v, f"{f.at(k)}.")
            return {str(s): d.integer(str(s), c, lo=0) for s, c in d.sd.items()}

        def flag(k: str, v: Any) -> bool:
            out = as_bool(v, ints=True)
            if out is None:
                f.fail(k, "a bool", v)
            return out

        def steps(k: str, v: Any) -> list[int]:
            return [f.integer(f"{k}[{i}]", x) for i, x in enumerate(f.seq(k, value=v))]

        score = per_rank("score", lambda k, v: f.number(k, v, lo=0.0))
        hosts = per_rank("hosts", lambda k, v: f.text(k, value=v), self.hosts)
        at = per_rank("at", f.integer, self.at)
        outlier_steps = per_rank("outlier_steps", lambda k, v: f.integer(k, v, lo=0),
                                 self.outlier_steps)
        by_signal = per_rank("by_signal", signals, self.by_signal)
        peak_z = per_rank("peak_z", lambda k, v: f.number(k, v, inf=True), self.peak_z)
        peak_signal = per_rank("peak_signal", lambda k, v: f.text(k, value=v), self.peak_signal)
        first_step = per_rank("first_step", opt_step, self.first_step)
        recent = per_rank("recent", steps, self.recent)
        suspect = per_rank("suspect", flag, self.suspect)
        suspect_since = per_rank("suspect_since", opt_step, self.suspect_since)
        self.reset()
        self.score, self.hosts, self.at, self.outlier_steps = score, hosts, at, outlier_steps
        self.by_signal, self.peak_z, self.peak_signal = by_signal, peak_z, peak_signal
        self.first_step, self.recent, self.suspect = first_step, recent, suspect
        self.suspect_since = suspect_since


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
