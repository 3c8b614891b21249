"""Tune detector parameters and thresholds offline, under a false-alarm budget.

1. **Score once.**  For every binding of the base config and every point of its parameter grid
   (from the detector's registry entry, :func:`stability.config.registry.tune_grids`), each run's
   detector scores are computed once, with ``threshold = +inf`` and
   ``freeze_on_alarm = False`` (so the score does not depend on the threshold), and reduced to
   one score per step (max over series).  These *scoring jobs* (one per run) run in local
   processes or on Ray (``backend="ray"``).
2. **Sweep thresholds.**  :mod:`replay.scoring` evaluates up to ``n_thresholds`` thresholds per
   candidate from per-run profiles, exactly as :mod:`replay.evaluate` would.
3. **Search** (:func:`make_tuner`).  By default (``search="warm"``, :class:`WarmTuner`) the
   search starts from the base config -- every binding on, at its threshold, thresholds only
   -- and moves one binding's threshold at a time; ``search="greedy"`` (:meth:`Tuner.search`,
   for a new set of bindings without trusted thresholds) switches bindings on one at a time
   from nothing over the parameter grids.  Each move picks the (parameter point, threshold) of
   one binding that maximises
   ``(recall, recall before divergence, mean lead, recall of invisible faults, -fa_per_10k)``
   lexicographically (warm: a move must raise recall), under two limits for the *union* of
   all bindings' alarms -- ``fa_per_10k <= budget`` and at most ``max_clean_alarmed`` of the
   clean runs with any alarm episode -- and detecting ``min_gain`` more labelled faults than
   before the move (a move fitted to one fault is refused).  With ``hold_back_clean``, that
   fraction of the clean runs is not tuned on, but both limits must hold on it too
   (:func:`hold_back`).  A binding the search leaves alone keeps its base setting
   (:meth:`Tuner.complete`).  Why the defaults (:mod:`replay.tuning_limits`): the "Limits"
   section of docs/guides/tuning.md.
4. **Cross-validate by run.**  With ``folds = K``, runs are dealt into K folds stratified by
   scenario; each fold is tuned on the others and evaluated on itself.  The pooled held-out
   figures are reported; the written config is tuned on all runs.

Detectors without a tunable threshold (``nonfinite``) are kept as they are.  Tuned bindings are
written with ``freeze_on_alarm = false`` where the detector has that parameter (the scores the
thresholds were tuned on assume it).  A binding whose base config freezes on alarms is also
scored as it is, at its base threshold (:attr:`Candidate.scored_at`): the start of the warm
search and what a binding left alone is counted with, exactly as the monitor runs it.

**The written config is complete.**  Every binding of the base config stays: the tuned ones with
their new parameters, the others (no tunable threshold, or no move within the limits:
loss-spike, weight-corruption and overfit protection among them) as they were.  Based on a
preset, the file is the preset line plus the tuned overrides (:meth:`TuneResult.file_config`),
under a header that lists what changed and what was kept (:meth:`TuneResult.header`).  The
figures ``tune`` prints (training and held-out) are those of that complete config: replaying
the file (``stability eval --config``) gives them.

Step 1 (candidates, scoring jobs) lives in :mod:`replay.tuning_scores`, the TOML writer in
:mod:`replay.config_toml`; this module re-exports both.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .config_toml import to_toml as to_toml
from .config_toml import write_config as write_config
from .evaluate import (
    DEFAULT_GAP,
    DEFAULT_TOLERANCE,
    DEFAULT_WINDOW,
    RunResult,
    Summary,
    evaluate_run,
    summarise,
)
from .fleet import RunFailure
from .labels import RunLabel
from .scoring import (
    RunProfile,
    Sweep,
    SweepSummary,
    candidate_thresholds,
    combine,
    run_profile,
    summarise_sweep,
    sweep,
)
from .tuning_limits import DEFAULT_HOLD_BACK as DEFAULT_HOLD_BACK
from .tuning_limits import DEFAULT_MAX_CLEAN_ALARMED as DEFAULT_MAX_CLEAN_ALARMED
from .tuning_limits import DEFAULT_MIN_GAIN as DEFAULT_MIN_GAIN
from .tuning_limits import DEFAULT_SEARCH as DEFAULT_SEARCH
from .tuning_limits import SEARCHES as SEARCHES
from .tuning_scores import (
    Candidate,
    RunScores,
    base_candidate,
    detector_defaults,
    make_candidates,
    score_runs,
)
from .tuning_scores import score_table as score_table

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


# ---------------------------------------------------------------------------- search
@dataclass
class Choice:
    """The selected candidate and threshold of one binding (``None`` = binding dropped)."""

    cand: int
    threshold: float


class Move(NamedTuple):
    """The best move of one binding: objective key, choice, faults it detects on the rows."""

    key: list[float]
    choice: Choice
    detected: int


@dataclass
class EvalSettings:
    """Evaluation definitions shared by tuning and evaluation."""

    window: int = DEFAULT_WINDOW
    tolerance: int = DEFAULT_TOLERANCE
    gap: int = DEFAULT_GAP


def _objective_keys(recall: FloatArray, before: FloatArray, lead: FloatArray,
                    invis: FloatArray, fa: FloatArray) -> list[FloatArray]:
    def z(a: FloatArray) -> FloatArray:
        return np.where(np.isnan(a), -1.0, a)

    return [z(recall), z(before), z(lead), z(invis), -z(fa)]


def clean_runs_alarmed(sw: Sweep) -> FloatArray:
    """Per threshold of ``sw``: the fraction of its clean runs with any false-alarm episode
    (``nan`` without a clean run), as :attr:`replay.evaluate.Summary.clean_runs_alarmed`.

    >>> from replay.labels import RunLabel
    >>> from replay.scoring import run_profile
    >>> steps = np.arange(50)
    >>> quiet, spiky = np.zeros(50), np.zeros(50)
    >>> spiky[20] = 3.0
    >>> prof = [run_profile(steps, s, RunLabel(r)) for r, s in (("a", quiet), ("b", spiky))]
    >>> clean_runs_alarmed(sweep(prof, np.array([1.0, 5.0]))).tolist()
    [0.5, 0.0]
    """
    clean = np.array([p.clean for p in sw.profiles], dtype=bool)
    if not clean.any():
        return np.full(sw.thresholds.size, np.nan)
    return np.asarray((sw.false_alarms[clean] > 0).mean(axis=0), dtype=np.float64)


def base_thresholds(base: Mapping[str, Any], candidates: Sequence[Candidate]
                    ) -> dict[int, float]:
    """``binding -> threshold`` of every tunable binding of the resolved config ``base`` (the
    detector's default when the config does not set it).

    >>> det = {"name": "s", "detector": "ewma_z", "inputs": ["loss"], "params": {"alpha": 0.3}}
    >>> base_thresholds({"detectors": [det]}, make_candidates([det], grids={}))
    {0: 6.0}
    """
    from stability.config.registry import detector_class

    out: dict[int, float] = {}
    for c in candidates:
        if not c.tunable or c.binding in out:
            continue
        params = base["detectors"][c.binding].get("params", {})
        th = params.get("threshold", detector_defaults(detector_class(c.detector))["threshold"])
        out[c.binding] = float(th)
    return out


def start_choices(base: Mapping[str, Any], candidates: Sequence[Candidate]
                  ) -> dict[int, Choice]:
    """The base config as tuner choices: every tunable binding on, its base parameters and
    threshold (a binding whose base setting has no candidate is left out)."""
    out = {}
    for b, th in base_thresholds(base, candidates).items():
        ci = base_candidate(candidates, base, b)
        if ci is not None:
            out[b] = Choice(ci, th)
    return out


#: a binding switched off (its threshold), and the threshold that stands for it in a sweep
_OFF, _OFF_SWEPT = math.inf, float(np.finfo(np.float64).max)


def _off_keeps_others(th: FloatArray) -> FloatArray:
    """Sweep thresholds with "off" (``inf``) replaced by the largest float: the other
    bindings' alarms (``inf`` scores, :func:`replay.scoring.combine`) stay alarms there, as they
    do when the binding is off (``inf > inf`` would drop them).

    >>> _off_keeps_others(np.array([1.0, np.inf])).tolist() == [1.0, _OFF_SWEPT]
    True
    """
    return np.where(th == _OFF, _OFF_SWEPT, th)


class Tuner:
    """Greedy search over bindings on precomputed scores (see the module docstring).

    ``budget`` (false-alarm episodes per 10k clean steps) and ``max_clean_alarmed`` (fraction
    of the clean runs with any alarm episode) are the two limits every move must keep on the
    runs it is tuned on, and on the held-back runs ``val`` of :meth:`search` when given.
    ``min_gain``: the fewest additional labelled faults a move must detect (0: any
    improvement of the objective, lead time and the other tie-breakers included).
    """

    def __init__(self, scores: Sequence[RunScores], candidates: Sequence[Candidate],
                 labels: Mapping[str, RunLabel], budget: float,
                 settings: EvalSettings | None = None, n_thresholds: int = 1000, *,
                 max_clean_alarmed: float = DEFAULT_MAX_CLEAN_ALARMED,
                 min_gain: int = DEFAULT_MIN_GAIN, start: Mapping[int, Choice] | None = None):
        if not 0.0 <= max_clean_alarmed <= 1.0:
            raise ValueError("The 'max_clean_alarmed' parameter of Tuner must be a float in "
                             f"the range [0, 1]. Got {max_clean_alarmed!r} instead.")
        if isinstance(min_gain, bool) or not isinstance(min_gain, int) or min_gain < 0:
            raise ValueError("The 'min_gain' parameter of Tuner must be an int in the range "
                             f"[0, inf). Got {min_gain!r} instead.")
        self.min_gain = min_gain
        self.scores = list(scores)
        self.cands = list(candidates)
        self.labels = [labels.get(r.run_id, RunLabel(r.run_id)) for r in self.scores]
        self.budget = float(budget)
        self.max_clean_alarmed = float(max_clean_alarmed)
        self.es = settings or EvalSettings()
        self.n_thresholds = n_thresholds
        self.bindings = sorted({c.binding for c in self.cands})
        self.fixed = [i for i, c in enumerate(self.cands) if not c.tunable]
        #: the base config's choice of every tunable binding (:func:`start_choices`)
        self.start = dict(start or {})
        self._mean_lead = math.nan

    def complete(self, choices: Mapping[int, Choice]) -> dict[int, Choice]:
        """The config ``choices`` are written as: every binding of :attr:`start` the search
        left alone at its base setting, the others as chosen (what the figures describe)."""
        return {**self.start, **choices}

    # alarms of a set of choices on one run
    def _alarms(self, run: int, choices: Mapping[int, Choice], skip: int | None = None
                ) -> BoolArray:
        n = self.scores[run].steps.size
        out = np.zeros(n, dtype=np.bool_)
        for ci in self.fixed:
            if self.cands[ci].binding != skip:
                out |= self.scores[run].scores[ci] > 0.0
        for b, ch in choices.items():
            if b != skip:
                out |= self.scores[run].scores[ch.cand] > ch.threshold
        return out

    def _profiles(self, rows: Sequence[int], cand: int, choices: Mapping[int, Choice],
                  skip: int) -> list[RunProfile]:
        es = self.es
        return [run_profile(self.scores[r].steps,
                            combine(self.scores[r].scores[cand], self._alarms(r, choices, skip)),
                            self.labels[r], window=es.window, tolerance=es.tolerance,
                            gap=es.gap) for r in rows]

    def _within_limits(self, prof: Sequence[RunProfile], th: FloatArray
                       ) -> tuple[BoolArray, SweepSummary, Sweep]:
        """Per threshold ``th`` (sorted): whether the false-alarm budget and the clean-run
        limit both hold on the runs of ``prof``; the figures there and the sweep."""
        sw = sweep(prof, th)
        sm = summarise_sweep(sw)
        if sm.clean_steps == 0:
            return np.ones(th.size, dtype=np.bool_), sm, sw
        return self._limits_hold(sm.fa_per_10k, clean_runs_alarmed(sw)), sm, sw

    def _limits_hold(self, fa_per_10k: Any, clean_alarmed: Any) -> Any:
        """Both limits, elementwise (arrays of a sweep or one config's figures): the budget
        and the clean-run limit (an undefined figure -- no clean step or run -- keeps them)."""
        return ~np.logical_or(np.greater(fa_per_10k, self.budget),
                              np.greater(clean_alarmed, self.max_clean_alarmed))

    def _best_for(self, rows: Sequence[int], b: int, choices: Mapping[int, Choice],
                  val: Sequence[int] = (), need: int | None = None) -> Move | None:
        """The best (candidate, threshold) of binding ``b`` within the limits on ``rows`` and
        on ``val`` (held back: thresholds come from ``rows`` only) that detects at least
        ``need`` of the faults of ``rows`` (``None``: any number)."""
        best: Move | None = None
        for ci, c in enumerate(self.cands):
            if c.binding != b or not c.sweepable:
                continue
            prof = self._profiles(rows, ci, choices, b)
            th = _off_keeps_others(candidate_thresholds(prof, self.n_thresholds))
            ok, sm, sw = self._within_limits(prof, th)
            detected = sw.detected.sum(axis=0)
            if need is not None:
                ok &= detected >= need
            if len(val):
                ok &= self._within_limits(self._profiles(val, ci, choices, b), th)[0]
            if not ok.any():
                continue
            keys = _objective_keys(sm.recall, sm.recall_before_divergence, sm.mean_lead,
                                   sm.recall_invisible, sm.fa_per_10k)
            idx = np.flatnonzero(ok)
            order = np.lexsort([k[idx] for k in reversed(keys)])
            j = int(idx[order[-1]])
            key = [float(k[j]) for k in keys]
            if best is None or key > best.key:
                best = Move(key, Choice(ci, _OFF if th[j] == _OFF_SWEPT else float(th[j])),
                            int(detected[j]))
        return best

    def _need(self, rows: Sequence[int], choices: Mapping[int, Choice]) -> int | None:
        """The fewest faults of ``rows`` a move from ``choices`` must detect: ``min_gain``
        more than ``choices`` do (``None`` when ``min_gain`` is 0: any move that improves
        the objective)."""
        if not self.min_gain:
            return None
        results = self.evaluate(rows, choices)[1]
        return sum(bool(r.detected) for r in results) + self.min_gain

    def _key_of(self, s: Summary) -> list[float]:
        lead = self._mean_lead
        vals = [s.recall, s.recall_before_divergence, lead, s.recall_invisible, s.fa_per_10k]
        z = [(-1.0 if (isinstance(v, float) and math.isnan(v)) else float(v)) for v in vals]
        z[-1] = -z[-1]
        return z

    def search(self, rows: Sequence[int], max_rounds: int | None = None, *,
               val: Sequence[int] = ()) -> dict[int, Choice]:
        """Greedy coordinate search on the runs ``rows``; returns ``binding -> Choice``.

        ``val``: held-back runs (never tuned on) on which every move must keep the limits too.
        A move must detect ``min_gain`` more faults of ``rows`` than the choices before it.
        """
        choices: dict[int, Choice] = {}
        tunable_b = [b for b in self.bindings
                     if any(c.binding == b and c.sweepable for c in self.cands)]
        rounds = max_rounds if max_rounds is not None else 2 * len(tunable_b) + 1
        current = self._score_choices(rows, choices)
        for _ in range(rounds):
            need = self._need(rows, choices)
            moves = []
            for b in tunable_b:
                r = self._best_for(rows, b, choices, val, need)
                if r is not None:
                    moves.append((r.key, b, r.choice))
            if not moves:
                break
            key, b, ch = max(moves, key=lambda m: m[0])
            if key <= current:
                break
            choices[b] = ch
            current = key
        return choices

    def _score_choices(self, rows: Sequence[int], choices: Mapping[int, Choice]) -> list[float]:
        s, results = self.evaluate(rows, choices)
        leads = [r.lead for r in results if r.lead is not None]
        self._mean_lead = float(np.mean(leads)) if leads else math.nan
        return self._key_of(s)

    def evaluate(self, rows: Sequence[int], choices: Mapping[int, Choice]
                 ) -> tuple[Summary, list[RunResult]]:
        """Evaluate choices on the runs ``rows`` with :func:`replay.evaluate.evaluate_run`."""
        es = self.es
        results = []
        for r in rows:
            a = self._alarms(r, choices)
            results.append(evaluate_run(self.scores[r].steps[a], self.scores[r].steps,
                                        self.labels[r], window=es.window,
                                        tolerance=es.tolerance, gap=es.gap))
        return summarise(results), results


class WarmTuner(Tuner):
    """The tuner started from the base config: every binding on at its base threshold.

    The same move generator (``_best_for``), objective and limits as :meth:`Tuner.search`;
    only the start point (:attr:`Tuner.start`), the check of the start point and the final
    placement of a moved threshold differ.  ``recall_only`` accepts a move only when it raises
    recall on visible faults (or restores the limits), not for the objective's tie-breakers
    (recall before divergence, lead, invisible faults).  A moved threshold is finally put in the
    middle of the interval over which the training figures do not change (:meth:`_widen`:
    maximum margin instead of the edge of a clean score).
    """

    def __init__(self, *args: Any, recall_only: bool = True, **kw: Any):
        super().__init__(*args, **kw)
        self.recall_only = recall_only

    def search(self, rows: Sequence[int], max_rounds: int | None = None, *,
               val: Sequence[int] = ()) -> dict[int, Choice]:
        """Moves from :attr:`Tuner.start` on ``rows``; returns every binding's choice.

        ``val``: held-back runs (never tuned on) on which every move must keep the limits too.
        While the start point breaks a limit on ``rows``, any move within the limits is taken
        (``min_gain`` waived: restoring the limits may lose faults).
        """
        choices = dict(self.start)
        tunable_b = sorted(self.start)
        rounds = max_rounds if max_rounds is not None else 2 * len(tunable_b) + 1
        current = self._score_choices(rows, choices)
        feasible = self._keeps_limits(rows, choices)
        if not feasible:
            current = [-math.inf] * len(current)
        for _ in range(rounds):
            need = self._need(rows, choices) if feasible else None
            moves = sorted(((r.key, b, r.choice) for b in tunable_b
                            if (r := self._best_for(rows, b, choices, val, need)) is not None),
                           key=lambda m: m[0], reverse=True)
            moves = [m for m in moves if m[0] > current and not (
                self.recall_only and m[0][0] <= current[0] and feasible)]
            if not moves:
                break
            key, b, ch = moves[0]
            choices[b] = ch
            current, feasible = key, True
        for b, ch in list(choices.items()):
            if ch.threshold != self.start[b].threshold:
                choices[b] = Choice(ch.cand, self._widen(rows, b, choices))
        return choices

    def _keeps_limits(self, rows: Sequence[int], choices: Mapping[int, Choice]) -> bool:
        """Whether ``choices`` keep the budget and the clean-run limit on ``rows``."""
        s = self.evaluate(rows, choices)[0]
        return bool(self._limits_hold(s.fa_per_10k, s.clean_runs_alarmed))

    def _widen(self, rows: Sequence[int], b: int, choices: Mapping[int, Choice]) -> float:
        """Middle of ``[th, next breakpoint)`` (geometric for a positive threshold): every
        training figure is the same there."""
        th = choices[b].threshold
        prof = self._profiles(rows, choices[b].cand, choices, b)
        v = candidate_thresholds(prof, 10**9)
        above = v[v > th]
        nxt = float(above[0]) if above.size else math.inf
        if not math.isfinite(th) or not math.isfinite(nxt):
            return th
        return math.sqrt(th * nxt) if th > 0 else 0.5 * (th + nxt)


def _check_search(search: str, where: str) -> None:
    if search not in SEARCHES:
        raise ValueError(f"The 'search' parameter of {where} must be one of {SEARCHES}. "
                         f"Got {search!r} instead.")


def make_tuner(search: str, scores: Sequence[RunScores], candidates: Sequence[Candidate],
               labels: Mapping[str, RunLabel], base: Mapping[str, Any], budget: float,
               settings: EvalSettings | None = None, n_thresholds: int = 1000, *,
               max_clean_alarmed: float = DEFAULT_MAX_CLEAN_ALARMED,
               min_gain: int = DEFAULT_MIN_GAIN, recall_only: bool = True) -> Tuner:
    """The tuner of ``search`` (:data:`SEARCHES`), started from the resolved config ``base``.

    ``"warm"`` (:class:`WarmTuner`): thresholds moved from the base config's, every binding on.
    ``"greedy"`` (:class:`Tuner`): bindings switched on one at a time from nothing, for a new
    set of bindings without trusted thresholds; a binding it leaves off is written (and
    counted, :meth:`Tuner.complete`) at its base setting.  ``recall_only``: warm only.
    """
    _check_search(search, "make_tuner")
    start = start_choices(base, candidates)
    kw: dict[str, Any] = {"max_clean_alarmed": max_clean_alarmed, "min_gain": min_gain,
                          "start": start}
    if search == "warm":
        return WarmTuner(scores, candidates, labels, budget, settings, n_thresholds,
                         recall_only=recall_only, **kw)
    return Tuner(scores, candidates, labels, budget, settings, n_thresholds, **kw)


def make_folds(run_ids: Sequence[str], labels: Mapping[str, RunLabel], k: int,
               seed: int = 0) -> list[list[int]]:
    """Deal run indices into ``k`` folds, stratified by scenario (clean runs are a stratum).

    >>> from replay.labels import RunLabel
    >>> labs = {"a": RunLabel("a"), "b": RunLabel("b"),
    ...         "c": RunLabel("c", "x", 5, None, "degraded")}
    >>> sorted(len(f) for f in make_folds(["a", "b", "c"], labs, 2))
    [1, 2]
    """
    rng = np.random.default_rng(seed)
    strata: dict[str, list[int]] = {}
    for i, rid in enumerate(run_ids):
        lab = labels.get(rid)
        strata.setdefault("clean" if lab is None or lab.is_clean else lab.scenario, []).append(i)
    folds: list[list[int]] = [[] for _ in range(k)]
    pos = 0
    for key in sorted(strata):
        idx = list(strata[key])
        rng.shuffle(idx)
        for i in idx:
            folds[pos % k].append(i)
            pos += 1
    return [sorted(f) for f in folds]


def hold_back(run_ids: Sequence[str], labels: Mapping[str, RunLabel], rows: Sequence[int],
              fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split ``rows`` into ``(tune, val)``: ``val`` is a random ``fraction`` of the clean runs
    among them (rounded down, at least one clean run left to tune on), never tuned on but
    checked by every move (:meth:`Tuner.search`).  Faulty runs are all tuned on.

    >>> from replay.labels import RunLabel
    >>> ids = ["c0", "c1", "c2", "c3", "f"]
    >>> labs = {"f": RunLabel("f", "x", 5, None, "degraded")}
    >>> tune, val = hold_back(ids, labs, range(5), 0.5)
    >>> len(val), 4 in tune, sorted(tune + val)
    (2, True, [0, 1, 2, 3, 4])
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("The 'fraction' parameter of hold_back must be a float in the range "
                         f"[0, 1]. Got {fraction!r} instead.")
    clean = sorted((r for r in rows if _is_clean(labels.get(run_ids[r]))),
                   key=lambda r: run_ids[r])
    n_val = min(int(fraction * len(clean)), max(len(clean) - 1, 0))
    picked = np.random.default_rng(seed).permutation(len(clean))[:n_val]
    val = sorted(clean[i] for i in picked)
    held = set(val)
    return [r for r in rows if r not in held], val


def _is_clean(label: RunLabel | None) -> bool:
    return label is None or label.is_clean


@dataclass
class TuneResult:
    """Output of :func:`tune`: the config, the choices and the figures."""

    config: dict[str, Any]
    choices: list[dict[str, Any]]
    train: Summary
    heldout: Summary | None
    fold_figures: list[dict[str, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    #: the preset the base config is (``None``: a config of its own, written whole)
    preset: str | None = None
    #: one line per tuned binding: what changed (``"loss_spike (ewma_z): threshold 6 -> 7.2"``)
    changed: list[str] = field(default_factory=list)
    #: the bindings kept as in the base config
    kept: list[str] = field(default_factory=list)

    def file_config(self) -> dict[str, Any]:
        """What ``tune -o`` writes: ``preset`` + the tuned bindings' parameters when the base
        is a preset (the loader merges them over it), else the whole :attr:`config`."""
        if self.preset is None:
            return self.config
        kept = set(self.kept)
        return {"preset": self.preset,
                "detectors": [{"name": d["name"], "params": d["params"]}
                              for d in self.config["detectors"] if d["name"] not in kept]}

    def header(self) -> str:
        """The comment lines above the written config: what changed and what was kept."""
        base = f"preset {self.preset!r}" if self.preset else "the base config"
        lines = [f"complete config: {base}, every binding kept; "
                 f"{len(self.changed)} tuned, {len(self.kept)} as before"]
        lines += [f"changed: {c}" for c in self.changed] or ["changed: nothing"]
        if self.kept:
            lines.append("kept: " + ", ".join(self.kept))
        return "\n".join(lines)


def tune_scores(scores: Sequence[RunScores], candidates: Sequence[Candidate],
                labels: Mapping[str, RunLabel], base: Mapping[str, Any], budget: float, *,
                folds: int = 5, settings: EvalSettings | None = None,
                n_thresholds: int = 1000, seed: int = 0, preset: str | None = None,
                max_clean_alarmed: float = DEFAULT_MAX_CLEAN_ALARMED,
                min_gain: int = DEFAULT_MIN_GAIN,
                hold_back_clean: float = DEFAULT_HOLD_BACK,
                search: str = DEFAULT_SEARCH) -> TuneResult:
    """Tune on precomputed scores; ``base`` is the resolved config dict the result is built on
    (``preset``: the preset it is, for :meth:`TuneResult.file_config`).

    ``search``: ``"warm"`` (from the base config) or ``"greedy"`` (from nothing),
    :func:`make_tuner`.  ``max_clean_alarmed``, ``min_gain``: as :class:`Tuner`;
    ``hold_back_clean``: the fraction of the clean runs of each training part held back to
    check every move (:func:`hold_back`; 0 = tune on all of them).  The figures (training and
    held-out) are those of the complete config written (:meth:`Tuner.complete`).
    """
    t0 = time.perf_counter()
    tuner = make_tuner(search, scores, candidates, labels, base, budget, settings,
                       n_thresholds, max_clean_alarmed=max_clean_alarmed, min_gain=min_gain)
    run_ids = [s.run_id for s in scores]

    def search_rows(rows: Sequence[int]) -> dict[int, Choice]:
        tune_rows, val = hold_back(run_ids, labels, rows, hold_back_clean, seed)
        return tuner.complete(tuner.search(tune_rows, val=val))

    all_rows = list(range(len(scores)))
    heldout: Summary | None = None
    fold_figs: list[dict[str, float]] = []
    if folds and folds > 1 and len(scores) >= folds:
        pooled: list[RunResult] = []
        for f in make_folds(run_ids, labels, folds, seed):
            held_out = set(f)
            fold_choices = search_rows([r for r in all_rows if r not in held_out])
            s, res = tuner.evaluate(f, fold_choices)
            pooled.extend(res)
            fold_figs.append({"runs": len(f), "recall": s.recall, "fa_per_10k": s.fa_per_10k,
                              "recall_before_divergence": s.recall_before_divergence,
                              "clean_runs_alarmed": s.clean_runs_alarmed})
        heldout = summarise(pooled)
    t1 = time.perf_counter()
    choices = search_rows(all_rows)
    train_summary = tuner.evaluate(all_rows, choices)[0]
    cfg = build_config(base, candidates, choices)
    desc = []
    for b, ch in sorted(choices.items()):
        c = candidates[ch.cand]
        st = tuner.start.get(b)
        desc.append({"binding": c.name, "detector": c.detector, "params": c.params_dict(),
                     "threshold": ch.threshold,
                     "base_threshold": None if st is None else st.threshold,
                     "moved": st is None or st != ch})
    changed, kept = describe_changes(base, cfg, choices)
    return TuneResult(cfg, desc, train_summary, heldout, fold_figs,
                      {"cv": t1 - t0, "final": time.perf_counter() - t1}, preset, changed, kept)


def build_config(base: Mapping[str, Any], candidates: Sequence[Candidate],
                 choices: Mapping[int, Choice]) -> dict[str, Any]:
    """The complete base config with the tuned bindings' parameters updated.

    Every binding is kept: one the tuner did not pick keeps its base parameters (dropping it
    would silently remove its protection from the written config).
    """
    cfg = copy.deepcopy(dict(base))
    cfg.pop("preset", None)
    dets = []
    for b, d in enumerate(cfg.get("detectors", [])):
        if b in choices:
            c = candidates[choices[b].cand]
            params = {**c.params_dict(), "threshold": _round_up(choices[b].threshold)}
            if not _same_setting(d, params):
                d = {**d, "params": params}
        dets.append(d)
    cfg["detectors"] = dets
    return cfg


def _same_setting(det: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """Whether ``params`` set binding ``det`` as its own parameters do (a parameter missing on
    either side counts at the detector's default): then the binding is written unchanged."""
    from stability.config.registry import detector_class

    from .tuning_scores import detector_defaults

    old = dict(det.get("params", {}))
    dflt = detector_defaults(detector_class(det["detector"]))
    return all(old.get(k, dflt.get(k)) == params.get(k, dflt.get(k))
               for k in set(old) | set(params))


def describe_changes(base: Mapping[str, Any], cfg: Mapping[str, Any],
                     choices: Mapping[int, Choice]) -> tuple[list[str], list[str]]:
    """``(changed, kept)``: one line per tuned binding (parameters before -> after), and the
    names of the bindings kept as in ``base``.

    >>> base = {"detectors": [{"name": "a", "detector": "ewma_z", "params": {"threshold": 6.0}},
    ...                       {"name": "b", "detector": "nonfinite"}]}
    >>> cfg = {"detectors": [{"name": "a", "detector": "ewma_z",
    ...                       "params": {"threshold": 7.5, "freeze_on_alarm": False}},
    ...                      {"name": "b", "detector": "nonfinite"}]}
    >>> describe_changes(base, cfg, {0: Choice(0, 7.5)})
    (['a (ewma_z): threshold 6 -> 7.5, freeze_on_alarm (default) -> False'], ['b'])
    """
    changed, kept = [], []
    for b, (old, new) in enumerate(zip(base.get("detectors", []), cfg["detectors"],
                                       strict=True)):
        if b not in choices or new == old:
            kept.append(str(new["name"]))
            continue
        p0, p1 = dict(old.get("params", {})), dict(new.get("params", {}))
        diffs = [f"{k} {_short(p0[k]) if k in p0 else '(default)'} -> {_short(p1[k])}"
                 for k in sorted(p1, key=lambda k: (k != "threshold", k))
                 if k not in p0 or p0[k] != p1[k]]
        changed.append(f"{new['name']} ({new['detector']}): "
                       + (", ".join(diffs) if diffs else "unchanged"))
    return changed, kept


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else repr(v)


def _round_up(x: float) -> float:
    """A float that prints in 10 significant digits and is >= ``x`` (alarms stay ``> x``)."""
    if not math.isfinite(x):
        return x
    y = float(f"{x:.10g}")
    if y < x:
        e = math.floor(math.log10(abs(x))) - 9 if x != 0 else 0
        y = float(f"{x + 10.0 ** e:.10g}")
    return y if y >= x else float(np.nextafter(x, math.inf))



# ---------------------------------------------------------------------------- entry point
def preset_of(cfg: Any) -> str | None:
    """The preset a resolved config *is* (its name when nothing overrides it), else ``None``.

    >>> from stability.config.config import load_config
    >>> preset_of(load_config("small")), preset_of(load_config({"preset": "small",
    ...     "detectors": [{"name": "loss_spike", "params": {"threshold": 9.0}}]}))
    ('small', None)
    """
    from stability.config.config import ConfigError, MonitorConfig

    name = getattr(cfg, "preset", None)
    if not name:
        return None
    try:
        same = MonitorConfig.from_preset(name).to_dict() == cfg.to_dict()
    except ConfigError:
        return None
    return str(name) if same else None


def tune(runs: Sequence[tuple[str, str]], labels: Mapping[str, RunLabel], budget: float, *,
         config: Any = None, folds: int = 5, backend: str = "local", jobs: int | None = None,
         settings: EvalSettings | None = None, grids: Mapping[str, Mapping[str, list[Any]]]
         | None = None, n_thresholds: int = 1000, progress: bool | None = None,
         address: str | None = None, failed: list[RunFailure] | None = None,
         max_clean_alarmed: float = DEFAULT_MAX_CLEAN_ALARMED,
         min_gain: int = DEFAULT_MIN_GAIN,
         hold_back_clean: float = DEFAULT_HOLD_BACK,
         search: str = DEFAULT_SEARCH) -> TuneResult:
    """Score ``runs`` with every candidate of ``config``'s bindings and tune (module docstring).

    Parameters
    ----------
    runs
        ``(run_id, path)`` pairs; runs without a label count as clean.
    labels
        ``run_id -> RunLabel``.
    budget
        Maximum false alarms per 10k clean steps (union of all bindings).
    max_clean_alarmed
        Maximum fraction of the clean runs with any alarm episode (union of all bindings).
    min_gain
        The fewest additional labelled faults a move must detect (0: any improvement).
    hold_back_clean
        Fraction of the clean runs held back from tuning; every move must keep both limits
        on them too (:func:`hold_back`; 0 = tune on all runs).
    search
        ``"warm"`` (default): every binding of ``config`` on, thresholds moved from its
        thresholds (parameters as in ``config``: no grid unless ``grids`` is given);
        ``"greedy"``: bindings switched on one at a time from nothing over the full parameter
        grids, for a new set of bindings (:func:`make_tuner`).
    config
        Base monitor config (preset name, path, dict; ``None`` = the default preset).
    backend, jobs, address
        Where the scoring jobs run (:func:`replay.fleet.fan_out`): local processes or Ray.
    failed
        Optional list: a run that cannot be read is appended there (a
        :class:`replay.fleet.RunFailure`) and tuning goes on without it; name it next to the
        figures.  Without it, its error propagates.
    """
    from stability.config.config import load_config

    resolved = load_config(config)
    base = resolved.to_dict()
    t0 = time.perf_counter()
    _check_search(search, "tune")  # before the scoring, which takes long
    cands = make_candidates(base["detectors"], {} if grids is None and search == "warm"
                            else grids)
    scores = score_runs(runs, cands, base.get("monitor", {}).get("aliases", {}),
                        backend=backend, jobs=jobs, progress=progress, address=address,
                        failed=failed)
    if not scores and failed:
        raise ValueError(f"none of the {len(runs)} runs could be read")
    t1 = time.perf_counter()
    res = tune_scores(scores, cands, labels, base, budget, folds=folds, settings=settings,
                      n_thresholds=n_thresholds, preset=preset_of(resolved),
                      max_clean_alarmed=max_clean_alarmed, min_gain=min_gain,
                      hold_back_clean=hold_back_clean, search=search)
    res.seconds["scoring"] = t1 - t0
    res.seconds["candidates"] = float(len(cands))
    return res
