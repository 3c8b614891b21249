"""Score matrices for threshold tuning: compute scores once, sweep thresholds in O(log n) each.

Every detector separates its continuous score from the threshold (``alarm = score >
threshold``), so for one parameter setting the scores of a run are computed once (with
``threshold = +inf`` and ``freeze_on_alarm = False``) and every threshold is then evaluated from
a small per-run *profile*:

* an alarm episode starts at row ``t`` for threshold ``th`` exactly when ``m_t <= th < s_t``,
  where ``s_t`` is the score and ``m_t`` the maximum score over the previous ``gap`` steps
  (see :func:`replay.evaluate.alarm_episodes`).  Only rows with ``s_t > m_t`` can ever start
  an episode; the profile keeps their ``(m_t, s_t, step)``.
* **false alarms**: with the sorted ``m`` and ``s`` of the clean-region rows, the number of
  false-alarm episodes is ``#{m <= th} - #{s <= th}`` -- two ``searchsorted``.
* **detection**: the first episode start in the detection window (and in the "before
  divergence" window) for *every* threshold at once: the intervals ``[m_t, s_t)`` are visited
  in step order and each assigns its step to the still-unassigned thresholds it covers
  (a union-find "next free" pointer), ``O((n + K) log K)`` per run.

The figures are identical to running :func:`replay.evaluate.evaluate_run` on the alarms
``score > th`` (tested).  Several detectors are combined with :func:`combine`: the union of
the alarms of the others becomes ``+inf`` in the score being swept.

Examples
--------
>>> from replay.labels import RunLabel
>>> steps = np.arange(100)
>>> s = np.zeros(100); s[30] = 5.0; s[60] = 9.0
>>> lab = RunLabel("r", "overfit", onset_step=50, outcome="degraded")
>>> p = run_profile(steps, s, lab, window=20, tolerance=0, gap=5)
>>> sw = sweep([p], np.array([1.0, 6.0, 10.0]))
>>> sw.detected[0].tolist(), sw.false_alarms[0].tolist(), sw.first_alarm[0].tolist()
([True, True, False], [1, 0, 0], [60, 60, -1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit
from numpy.typing import NDArray

from .evaluate import DEFAULT_GAP, DEFAULT_TOLERANCE, DEFAULT_WINDOW, detection_window
from .labels import RunLabel

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

NEG_INF = -np.inf


def reduce_series(scores: FloatArray) -> FloatArray:
    """Per-step maximum over series, ignoring ``nan`` (missing); ``-inf`` when nothing scored.

    >>> reduce_series(np.array([[1.0, np.nan], [np.nan, np.nan], [np.inf, 2.0]])).tolist()
    [1.0, -inf, inf]
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1:
        s = s[:, None]
    if s.shape[1] == 0:
        return np.full(s.shape[0], NEG_INF)
    out = np.where(np.isnan(s), NEG_INF, s).max(axis=1)
    return np.ascontiguousarray(out)


@njit(cache=True, error_model="numpy")
def _prev_max(steps, s, out_m):  # type: ignore[no-untyped-def]
    """``out_m[t]`` = max of ``s`` over the rows with steps in ``[steps[t] - gap, steps[t])``.

    ``gap`` is passed as ``out_m[0]`` on entry (to keep the signature small).
    """
    n = s.shape[0]
    if n == 0:
        return
    gap = out_m[0]
    dq = np.empty(n, dtype=np.int64)
    head = 0
    tail = 0
    for t in range(n):
        lo = steps[t] - gap
        while head < tail and steps[dq[head]] < lo:
            head += 1
        out_m[t] = s[dq[head]] if head < tail else -np.inf
        st = s[t]
        while head < tail and s[dq[tail - 1]] <= st:
            tail -= 1
        dq[tail] = t
        tail += 1


def previous_max(steps: IntArray, score: FloatArray, gap: int) -> FloatArray:
    """Max score over the previous ``gap`` steps of each row (``-inf`` if none).

    >>> previous_max(np.arange(5), np.array([3.0, 1.0, 2.0, 0.0, 0.0]), 2).tolist()
    [-inf, 3.0, 3.0, 2.0, 2.0]
    """
    out = np.empty(score.shape[0])
    if out.size:
        out[0] = gap
        _prev_max(np.ascontiguousarray(steps, dtype=np.int64),
                  np.ascontiguousarray(score, dtype=np.float64), out)
    return out


@njit(cache=True, error_model="numpy")
def _find(nxt, i):  # type: ignore[no-untyped-def]
    r = i
    while nxt[r] != r:
        r = nxt[r]
    while nxt[i] != r:
        j = nxt[i]
        nxt[i] = r
        i = j
    return r


@njit(cache=True, error_model="numpy")
def _first_starts(m, s, t, th, out):  # type: ignore[no-untyped-def]
    """``out[k]`` = step of the first interval (in order) with ``m <= th[k] < s`` (else -1)."""
    k_n = th.shape[0]
    nxt = np.arange(k_n + 1)
    for k in range(k_n):
        out[k] = -1
    for j in range(m.shape[0]):
        a = np.searchsorted(th, m[j], side="left")
        b = np.searchsorted(th, s[j], side="left")
        i = _find(nxt, a)
        while i < b:
            out[i] = t[j]
            nxt[i] = i + 1
            i = _find(nxt, i + 1)


@dataclass
class RunProfile:
    """Everything needed to evaluate any threshold on one run (see the module docstring).

    ``det_*`` / ``div_*``: ``(m, s, step)`` of the rows that may start an episode in the
    detection / before-divergence window, in step order; ``fa_m`` / ``fa_s``: sorted ``m`` and
    ``s`` of such rows in the clean region.
    """

    run_id: str
    clean: bool
    visible: bool
    onset: int
    clean_steps: int
    det_m: FloatArray
    det_s: FloatArray
    det_t: IntArray
    div_eligible: bool
    div_ref: int
    div_m: FloatArray
    div_s: FloatArray
    div_t: IntArray
    fa_m: FloatArray
    fa_s: FloatArray


def run_profile(steps: IntArray, score: FloatArray, label: RunLabel, *,
                window: int = DEFAULT_WINDOW, tolerance: int = DEFAULT_TOLERANCE,
                gap: int = DEFAULT_GAP) -> RunProfile:
    """Build the threshold-sweep profile of one run from its per-step score.

    Parameters
    ----------
    steps
        The run's steps, increasing.
    score
        One score per step (``-inf`` = nothing scored, ``+inf`` = always an alarm).
    label
        The run's label (a clean run has no onset).
    """
    st = np.ascontiguousarray(steps, dtype=np.int64)
    s = np.ascontiguousarray(score, dtype=np.float64)
    s = np.where(np.isnan(s), NEG_INF, s)
    m = previous_max(st, s, gap)
    can = s > m
    n = st.size
    win = detection_window(label, window, tolerance)
    ef, ei = np.empty(0), np.empty(0, dtype=np.int64)
    det = div = (ef, ef, ei)
    onset, ref, eligible = -1, -1, False
    if win is None:
        n_clean = n
    else:
        lo, hi = win
        onset = int(label.onset_step)  # type: ignore[arg-type]
        n_clean = int(np.searchsorted(st, lo, side="left"))

        def rows(i1: int) -> tuple[FloatArray, FloatArray, IntArray]:
            k = np.flatnonzero(can[n_clean:i1]) + n_clean
            return m[k], s[k], st[k]

        det = rows(int(np.searchsorted(st, hi, side="right")))
        r = label.divergence_ref
        eligible = r is not None and r > onset
        ref = -1 if r is None else int(r)
        if eligible:
            div = rows(int(np.searchsorted(st, ref - 1, side="right")))
    c = can[:n_clean]
    return RunProfile(
        run_id=label.run_id, clean=win is None, visible=label.visible, onset=onset,
        clean_steps=n_clean, det_m=det[0], det_s=det[1], det_t=det[2], div_eligible=eligible,
        div_ref=ref, div_m=div[0], div_s=div[1], div_t=div[2],
        fa_m=np.sort(m[:n_clean][c]), fa_s=np.sort(s[:n_clean][c]),
    )


@dataclass
class Sweep:
    """Per-run, per-threshold figures: arrays of shape ``(n_runs, n_thresholds)``.

    ``first_alarm`` / ``lead`` are ``-1`` where there is none.
    """

    thresholds: FloatArray
    detected: BoolArray
    first_alarm: IntArray
    before: BoolArray
    lead: IntArray
    false_alarms: IntArray
    profiles: Sequence[RunProfile]


def _first(m: FloatArray, s: FloatArray, t: IntArray, th: FloatArray) -> IntArray:
    out = np.empty(th.size, dtype=np.int64)
    if m.size == 0:
        out[:] = -1
        return out
    _first_starts(m, s, t, th, out)
    return out


def sweep(profiles: Sequence[RunProfile], thresholds: FloatArray) -> Sweep:
    """Evaluate every threshold on every run profile (vectorised over thresholds).

    ``thresholds`` must be sorted ascending.
    """
    th = np.ascontiguousarray(thresholds, dtype=np.float64)
    if th.size > 1 and np.any(np.diff(th) < 0):
        raise ValueError("sweep(): thresholds must be sorted ascending.")
    r, k = len(profiles), th.size
    first = np.full((r, k), -1, dtype=np.int64)
    lead = np.full((r, k), -1, dtype=np.int64)
    fa = np.zeros((r, k), dtype=np.int64)
    for i, p in enumerate(profiles):
        if p.fa_m.size:
            fa[i] = (np.searchsorted(p.fa_m, th, side="right")
                     - np.searchsorted(p.fa_s, th, side="right"))
        if not p.clean:
            first[i] = _first(p.det_m, p.det_s, p.det_t, th)
            if p.div_eligible:
                f = _first(p.div_m, p.div_s, p.div_t, th)
                lead[i] = np.where(f >= 0, p.div_ref - f, -1)
    return Sweep(thresholds=th, detected=first >= 0, first_alarm=first, before=lead >= 0,
                 lead=lead, false_alarms=fa, profiles=profiles)


@dataclass
class SweepSummary:
    """Figures per threshold, aggregated over a subset of runs (arrays of ``n_thresholds``)."""

    recall: FloatArray
    recall_invisible: FloatArray
    recall_before_divergence: FloatArray
    mean_lead: FloatArray
    false_alarms: IntArray
    clean_steps: int
    fa_per_10k: FloatArray


def summarise_sweep(sw: Sweep, rows: Sequence[int] | None = None) -> SweepSummary:
    """Aggregate a :class:`Sweep` over the runs ``rows`` (default all); ``nan`` if undefined."""
    idx = np.arange(len(sw.profiles)) if rows is None else np.asarray(rows, dtype=np.int64)
    prof = [sw.profiles[i] for i in idx]
    vis = np.array([not p.clean and p.visible for p in prof], dtype=bool)
    inv = np.array([not p.clean and not p.visible for p in prof], dtype=bool)
    div = np.array([p.div_eligible for p in prof], dtype=bool)
    k = sw.thresholds.size

    def rate(mask: BoolArray, m: BoolArray) -> FloatArray:
        if not mask.any():
            return np.full(k, np.nan)
        return np.asarray(m[idx][mask].mean(axis=0), dtype=np.float64)

    lead = sw.lead[idx][div].astype(np.float64) if div.any() else np.empty((0, k))
    caught = lead >= 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_lead = np.where(caught.any(axis=0),
                             np.where(caught, lead, 0.0).sum(axis=0) / caught.sum(axis=0),
                             np.nan)
    fa = sw.false_alarms[idx].sum(axis=0)
    cs = int(sum(p.clean_steps for p in prof))
    return SweepSummary(
        recall=rate(vis, sw.detected), recall_invisible=rate(inv, sw.detected),
        recall_before_divergence=rate(div, sw.before), mean_lead=np.asarray(mean_lead),
        false_alarms=fa, clean_steps=cs,
        fa_per_10k=(1e4 * fa / cs) if cs else np.full(k, np.nan),
    )


def combine(score: FloatArray, others: BoolArray | None) -> FloatArray:
    """Score whose alarms at threshold ``th`` are ``(score > th) | others``.

    >>> combine(np.array([1.0, 2.0, 3.0]), np.array([False, True, False])).tolist()
    [1.0, inf, 3.0]
    """
    if others is None:
        return score
    return np.where(others, np.inf, score)


def candidate_thresholds(profiles: Sequence[RunProfile], n: int = 1000) -> FloatArray:
    """Up to ``n`` thresholds at which some figure changes (quantiles of the breakpoints).

    Every figure changes only at an ``m``/``s`` endpoint of an episode interval, so thresholds
    are placed exactly on those values (``alarm = score > th``; a threshold equal to a value
    excludes it).
    """
    parts = [np.concatenate([p.det_m, p.det_s, p.div_m, p.div_s, p.fa_m, p.fa_s])
             for p in profiles]
    v = np.concatenate(parts) if parts else np.empty(0)
    v = np.unique(v[np.isfinite(v)])
    if v.size > n:
        v = np.unique(np.quantile(v, np.linspace(0.0, 1.0, n), method="nearest"))
    return np.concatenate([v, [np.inf]])
