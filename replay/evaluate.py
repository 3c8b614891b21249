"""Score alarms against labelled faults: pure functions, in the style of river's drift evaluation.

What counts
-----------
For one run with label ``L`` and alarm steps ``A`` (steps where *any* detector alarmed):

* **Episodes.**  Alarms closer than ``gap`` steps are one *alarm episode*: an alarm at step ``t``
  starts a new episode when the previous alarm is at a step ``< t - gap``.  False alarms are
  counted in episodes, not raw alarm steps (a detector that alarms for 30 consecutive steps
  raised one alarm).
* **Clean region.**  Every logged step of a clean run, and the logged steps ``< onset - tolerance``
  of a faulty run.  ``clean_steps`` is their number.
* **False alarm.**  An episode that *starts* in the clean region.  ``fa_per_10k`` is false
  alarms per 10,000 clean steps, summed over runs.
* **Detection window.**  ``[onset - tolerance, max(onset + window, divergence_ref - 1)]`` --
  the fault counts as detected when an alarm *episode starts* in it (an alarm that has been
  ringing since before the fault is the false alarm it already was, not a detection).
  ``delay = first episode start in the window - onset`` (negative within the tolerance).
* **Divergence reference** ``divergence_ref = min(nan_step, failure_step, divergence_step)``.
  A run is *eligible* for "recall before divergence" when ``divergence_ref > onset`` (when it
  equals the onset no warning can precede it; such runs are counted as ``n_div_immediate``).
  It is caught *before* divergence when an episode starts in
  ``[onset - tolerance, divergence_ref)``; ``lead = divergence_ref - first such start``.
* **Visible vs invisible.**  ``degraded`` and ``diverged`` runs are visible; ``recovered`` runs
  are visible only when they have an ``effect_step`` (a transient loss effect).  The headline
  ``recall`` is over visible faults; invisible (recovered, no loss effect) runs are reported
  separately as ``recall_invisible`` -- catching them is a bonus, missing them is not a failure.
* **Precision.**  Episodes starting in a detection window over all episodes that start either in
  a detection window or in the clean region (episodes after the window of a faulty run are
  neither).
* Undefined figures (no eligible run, no episode, ...) are ``nan``.

Examples
--------
>>> from replay.labels import RunLabel
>>> lab = RunLabel("r", "grad_explosion", onset_step=100, outcome="diverged", nan_step=150)
>>> res = evaluate_run([20, 21, 22, 105, 106], np.arange(200), lab, tolerance=0)
>>> res.false_alarms, res.detected, res.delay, res.lead, res.clean_steps
(1, True, 5, 45, 100)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .labels import RunLabel

#: alarms closer than this many steps form one episode
DEFAULT_GAP = 25
#: steps after the onset in which a first alarm counts as a detection
DEFAULT_WINDOW = 200
#: steps before the labelled onset still accepted as a detection
DEFAULT_TOLERANCE = 5

IntArray = NDArray[np.int64]


def _as_steps(x: ArrayLike) -> IntArray:
    a = np.unique(np.asarray(x, dtype=np.int64).ravel())
    return a


def alarm_episodes(alarms: ArrayLike, gap: int = DEFAULT_GAP) -> list[tuple[int, int]]:
    """Merge alarm steps closer than ``gap`` into ``(first, last)`` episodes.

    An alarm at ``t`` starts a new episode when the previous alarm is at a step ``< t - gap``.

    >>> alarm_episodes([3, 4, 5, 40, 41, 100], gap=10)
    [(3, 5), (40, 41), (100, 100)]
    >>> alarm_episodes([0, 10, 20], gap=10)
    [(0, 20)]
    >>> alarm_episodes([])
    []
    """
    a = _as_steps(alarms)
    if a.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(a) > gap)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [a.size - 1]])
    return [(int(a[s]), int(a[e])) for s, e in zip(starts, ends, strict=True)]


def episode_starts(alarms: ArrayLike, gap: int = DEFAULT_GAP) -> IntArray:
    """First step of every alarm episode (see :func:`alarm_episodes`).

    >>> episode_starts([3, 4, 5, 40, 41, 100], gap=10).tolist()
    [3, 40, 100]
    """
    a = _as_steps(alarms)
    if a.size == 0:
        return a
    keep = np.concatenate([[True], np.diff(a) > gap])
    return a[keep]


class MatchResult(NamedTuple):
    """Outcome of :func:`match`: counts and the delay of every detected event."""

    tp: int
    fp: int
    fn: int
    delays: tuple[int, ...]

    @property
    def precision(self) -> float:
        """``tp / (tp + fp)``; ``nan`` without alarms."""
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else math.nan

    @property
    def recall(self) -> float:
        """``tp / (tp + fn)``; ``nan`` without events."""
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else math.nan

    @property
    def mean_delay(self) -> float:
        """Mean detection delay over the detected events; ``nan`` if none was detected."""
        return float(np.mean(self.delays)) if self.delays else math.nan


def match(alarms: ArrayLike, events: ArrayLike, delta_max: int) -> MatchResult:
    """Match alarm steps to event (fault onset) steps, river-style.

    An event at ``e`` is detected by the first alarm in ``[e, e + delta_max]`` (and before the
    next event); that alarm is a true positive with delay ``alarm - e``.  Further alarms inside
    the same event's window are ignored; every alarm outside all windows is a false positive.
    Events without a matching alarm are false negatives.

    >>> m = match([5, 12, 13, 50, 90], events=[10, 80], delta_max=20)
    >>> m
    MatchResult(tp=2, fp=2, fn=0, delays=(2, 10))
    >>> m.precision, m.recall, m.mean_delay
    (0.5, 1.0, 6.0)
    >>> match([], [10], 5).recall, match([3], [], 5).recall
    (0.0, nan)
    """
    a = _as_steps(alarms)
    ev = _as_steps(events)
    in_window = np.zeros(a.size, dtype=bool)
    delays: list[int] = []
    for i, e in enumerate(ev):
        hi = e + delta_max
        if i + 1 < ev.size:
            hi = min(hi, int(ev[i + 1]) - 1)
        lo_i = int(np.searchsorted(a, e, side="left"))
        hi_i = int(np.searchsorted(a, hi, side="right"))
        if hi_i > lo_i:
            delays.append(int(a[lo_i] - e))
            in_window[lo_i:hi_i] = True
    tp = len(delays)
    return MatchResult(tp=tp, fp=int((~in_window).sum()), fn=int(ev.size - tp),
                       delays=tuple(delays))


def first_alarm_in(alarms: ArrayLike, lo: int, hi: int) -> int | None:
    """First alarm step in the closed range ``[lo, hi]`` (``None`` if there is none).

    >>> first_alarm_in([1, 7, 9], 5, 8), first_alarm_in([1, 7, 9], 2, 6)
    (7, None)
    """
    a = _as_steps(alarms)
    i = int(np.searchsorted(a, lo, side="left"))
    if i < a.size and a[i] <= hi:
        return int(a[i])
    return None


@dataclass
class RunResult:
    """Evaluation of one run (see the module docstring for the definitions)."""

    run_id: str
    scenario: str
    outcome: str
    visible: bool
    n_steps: int
    clean_steps: int
    false_alarms: int
    episodes: int
    window_episodes: int = 0
    detected: bool | None = None
    first_alarm: int | None = None
    delay: int | None = None
    divergence_ref: int | None = None
    caught_before_divergence: bool | None = None
    lead: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def detection_window(label: RunLabel, window: int = DEFAULT_WINDOW,
                     tolerance: int = DEFAULT_TOLERANCE) -> tuple[int, int] | None:
    """Closed step range in which an alarm detects the fault (``None`` for clean runs).

    >>> lab = RunLabel("r", "lr_too_high", onset_step=100, outcome="diverged", failure_step=900)
    >>> detection_window(lab, window=200, tolerance=5)
    (95, 899)
    """
    if label.onset_step is None:
        return None
    onset = label.onset_step
    hi = onset + window
    ref = label.divergence_ref
    if ref is not None:
        hi = max(hi, ref - 1)
    return onset - tolerance, hi


def evaluate_run(alarms: ArrayLike, steps: ArrayLike, label: RunLabel, *,
                 window: int = DEFAULT_WINDOW, tolerance: int = DEFAULT_TOLERANCE,
                 gap: int = DEFAULT_GAP) -> RunResult:
    """Evaluate the alarm steps of one run against its label.

    Parameters
    ----------
    alarms
        Steps at which any detector alarmed (duplicates are fine).  Episodes are built from
        all of them (see the module docstring).
    steps
        The run's logged steps (its ``step`` column); used to count clean steps.
    label
        The run's :class:`~replay.labels.RunLabel`.
    window, tolerance, gap
        Detection window after the onset, tolerance before it, and the episode gap.

    >>> evaluate_run([], np.arange(10), RunLabel("c")).false_alarms
    0
    >>> evaluate_run([3], np.arange(10), RunLabel("c")).detected is None
    True
    """
    a = _as_steps(alarms)
    st = np.asarray(steps, dtype=np.int64)
    starts = episode_starts(a, gap)
    res = RunResult(run_id=label.run_id, scenario=label.scenario, outcome=label.outcome,
                    visible=label.visible, n_steps=int(st.size), clean_steps=int(st.size),
                    false_alarms=int(starts.size), episodes=int(starts.size))
    win = detection_window(label, window, tolerance)
    if win is None:
        return res
    lo, hi = win
    onset = int(label.onset_step)  # type: ignore[arg-type]
    res.clean_steps = int((st < lo).sum())
    res.false_alarms = int((starts < lo).sum())
    res.window_episodes = int(((starts >= lo) & (starts <= hi)).sum())
    first = first_alarm_in(starts, lo, hi)
    res.detected = first is not None
    res.first_alarm = first
    res.delay = None if first is None else first - onset
    ref = label.divergence_ref
    res.divergence_ref = ref
    if ref is not None and ref > onset:
        f = first_alarm_in(starts, lo, ref - 1)
        res.caught_before_divergence = f is not None
        res.lead = None if f is None else ref - f
    return res


def _rate(num: int, den: int) -> float:
    return num / den if den else math.nan


def _median(xs: Sequence[float]) -> float:
    return float(np.median(xs)) if len(xs) else math.nan


@dataclass
class Summary:
    """Aggregate figures over many runs (see the module docstring for the definitions)."""

    n_runs: int = 0
    n_clean: int = 0
    n_faulty: int = 0
    n_visible: int = 0
    n_invisible: int = 0
    recall: float = math.nan
    recall_invisible: float = math.nan
    recall_all: float = math.nan
    n_div: int = 0
    n_div_immediate: int = 0
    recall_before_divergence: float = math.nan
    median_lead: float = math.nan
    median_delay: float = math.nan
    false_alarms: int = 0
    clean_steps: int = 0
    fa_per_10k: float = math.nan
    clean_runs_alarmed: float = math.nan
    precision: float = math.nan
    per_scenario: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def summarise(results: Iterable[RunResult]) -> Summary:
    """Aggregate :class:`RunResult` objects into a :class:`Summary`.

    >>> from replay.labels import RunLabel
    >>> r1 = evaluate_run([], np.arange(100), RunLabel("c"))
    >>> r2 = evaluate_run([60], np.arange(100),
    ...                   RunLabel("f", "overfit", onset_step=50, outcome="degraded"))
    >>> s = summarise([r1, r2])
    >>> s.recall, s.median_delay, s.fa_per_10k, s.recall_before_divergence
    (1.0, 10.0, 0.0, nan)
    """
    rs = list(results)
    clean = [r for r in rs if r.detected is None]
    faulty = [r for r in rs if r.detected is not None]
    vis = [r for r in faulty if r.visible]
    invis = [r for r in faulty if not r.visible]
    div = [r for r in faulty if r.caught_before_divergence is not None]
    immediate = [r for r in faulty if r.divergence_ref is not None
                 and r.caught_before_divergence is None]
    fa = sum(r.false_alarms for r in rs)
    cs = sum(r.clean_steps for r in rs)
    tp_ep = sum(r.window_episodes for r in faulty)
    s = Summary(
        n_runs=len(rs), n_clean=len(clean), n_faulty=len(faulty), n_visible=len(vis),
        n_invisible=len(invis),
        recall=_rate(sum(bool(r.detected) for r in vis), len(vis)),
        recall_invisible=_rate(sum(bool(r.detected) for r in invis), len(invis)),
        recall_all=_rate(sum(bool(r.detected) for r in faulty), len(faulty)),
        n_div=len(div), n_div_immediate=len(immediate),
        recall_before_divergence=_rate(sum(bool(r.caught_before_divergence) for r in div),
                                       len(div)),
        median_lead=_median([r.lead for r in div if r.lead is not None]),
        median_delay=_median([r.delay for r in vis if r.delay is not None]),
        false_alarms=fa, clean_steps=cs,
        fa_per_10k=1e4 * fa / cs if cs else math.nan,
        clean_runs_alarmed=_rate(sum(r.false_alarms > 0 for r in clean), len(clean)),
        precision=_rate(tp_ep, tp_ep + fa),
    )
    for sc in sorted({r.scenario for r in faulty}):
        group = [r for r in faulty if r.scenario == sc]
        s.per_scenario[sc] = {
            "n": len(group),
            "visible": sum(r.visible for r in group),
            "detected": sum(bool(r.detected) for r in group),
            "recall": _rate(sum(bool(r.detected) for r in group), len(group)),
            "median_delay": _median([r.delay for r in group if r.delay is not None]),
        }
    return s


def evaluate_runs(alarms: Mapping[str, ArrayLike], steps: Mapping[str, ArrayLike],
                  labels: Mapping[str, RunLabel], *, window: int = DEFAULT_WINDOW,
                  tolerance: int = DEFAULT_TOLERANCE, gap: int = DEFAULT_GAP,
                  ) -> tuple[Summary, list[RunResult]]:
    """Evaluate many runs; runs without a label are treated as clean.

    Parameters
    ----------
    alarms
        ``run_id -> alarm steps``.
    steps
        ``run_id -> logged steps`` (defines which runs are evaluated).
    labels
        ``run_id -> RunLabel``; unlabelled runs count as clean (e.g. a folder of clean runs).
    """
    results = []
    for rid in steps:
        lab = labels.get(rid, RunLabel(rid))
        results.append(evaluate_run(alarms.get(rid, ()), steps[rid], lab, window=window,
                                    tolerance=tolerance, gap=gap))
    return summarise(results), results


def _fmt(v: float, pct: bool = False, digits: int = 1) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if pct:
        return f"{100 * v:.0f}%"
    return f"{v:.{digits}f}"


TABLE_COLUMNS = (
    ("recall", "recall", True),
    ("recall_invisible", "rec.invis", True),
    ("recall_before_divergence", "before-div", True),
    ("median_lead", "lead", False),
    ("median_delay", "delay", False),
    ("fa_per_10k", "FA/10k", False),
    ("clean_runs_alarmed", "clean-alarmed", True),
    ("precision", "precision", True),
)


def format_table(rows: Mapping[str, Summary], title: str = "") -> str:
    """Render summaries (one row per detector / config) as a fixed-width text table.

    >>> print(format_table({"x": Summary(recall=0.5, fa_per_10k=1.25)}))  # doctest: +ELLIPSIS
    name  recall  rec.invis ...
    x        50%          - ...
    """
    headers = ["name"] + [h for _, h, _ in TABLE_COLUMNS]
    body = []
    for name, s in rows.items():
        cells = [name]
        for attr, _, pct in TABLE_COLUMNS:
            v = getattr(s, attr)
            cells.append(_fmt(v, pct, 2 if attr == "fa_per_10k" else 0 if not pct else 1))
        body.append(cells)
    widths = [max(len(r[i]) for r in [headers, *body]) for i in range(len(headers))]
    lines = [title] if title else []

    def fmt_row(r: list[str]) -> str:
        cells = [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        return "  ".join([r[0].ljust(widths[0]), *cells])

    lines.append(fmt_row(headers))
    lines.extend(fmt_row(r) for r in body)
    return "\n".join(lines)


def format_scenarios(s: Summary) -> str:
    """Per-scenario breakdown as text lines.

    >>> s = Summary(per_scenario={"overfit": {"n": 2, "visible": 2, "detected": 1,
    ...                                       "recall": 0.5, "median_delay": 30.0}})
    >>> print(format_scenarios(s))
    overfit                     1/2 detected (visible 2)  median delay 30
    """
    lines = []
    for sc, d in s.per_scenario.items():
        delay = _fmt(d["median_delay"], False, 0)
        lines.append(f"{sc:<26} {int(d['detected']):>2}/{int(d['n'])} detected "
                     f"(visible {int(d['visible'])})  median delay {delay}")
    return "\n".join(lines)
