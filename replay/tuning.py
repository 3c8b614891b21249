"""Tune detector parameters and thresholds offline, under a false-alarm budget.

1. **Score once.**  For every binding of the base config and every point of its parameter grid
   (from the detector's registry entry, :func:`stability.registry.tune_grids`), each run's
   detector scores are computed once, with ``threshold = +inf`` and
   ``freeze_on_alarm = False`` (so the score does not depend on the threshold), and reduced to
   one score per step (max over series).  These *scoring jobs* (one per run) run in local
   processes or on Ray (``backend="ray"``).
2. **Sweep thresholds.**  :mod:`replay.scoring` evaluates up to ``n_thresholds`` thresholds per
   candidate from per-run profiles, exactly as :mod:`replay.evaluate` would.
3. **Combine greedily.**  Bindings are switched on / retuned one move at a time: each move picks
   the (parameter point, threshold) of one binding that maximises, under
   ``fa_per_10k <= budget`` for the *union* of all bindings' alarms,
   ``(recall, recall before divergence, mean lead, recall of invisible faults, -fa_per_10k)``
   lexicographically.  Bindings that never help are dropped.
4. **Cross-validate by run.**  With ``folds = K``, runs are dealt into K folds stratified by
   scenario; each fold is tuned on the others and evaluated on itself.  The pooled held-out
   figures are reported; the written config is tuned on all runs.

Detectors without a tunable threshold (``nonfinite``) are kept as they are.  Tuned bindings are
written with ``freeze_on_alarm = false`` where the detector has that parameter (the scores the
thresholds were tuned on assume it).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from stability.registry import tune_grids

from .evaluate import (
    DEFAULT_GAP,
    DEFAULT_TOLERANCE,
    DEFAULT_WINDOW,
    RunResult,
    Summary,
    evaluate_run,
    summarise,
)
from .labels import RunLabel
from .replay import Progress, parallel_map, read_table
from .scoring import (
    RunProfile,
    candidate_thresholds,
    combine,
    reduce_series,
    run_profile,
    summarise_sweep,
    sweep,
)

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]



# ---------------------------------------------------------------------------- candidates
@dataclass(frozen=True)
class Candidate:
    """One parameter setting of one binding."""

    binding: int
    name: str
    detector: str
    inputs: tuple[str, ...]
    params: tuple[tuple[str, Any], ...]
    tunable: bool

    def params_dict(self) -> dict[str, Any]:
        """The parameters as a dict."""
        return dict(self.params)


def _init_args(cls: type) -> list[str]:
    init = cls.__init__  # type: ignore[misc]
    return [p for p in inspect.signature(init).parameters if p != "self"]


def make_candidates(detectors: Sequence[Mapping[str, Any]],
                    grids: Mapping[str, Mapping[str, list[Any]]] | None = None
                    ) -> list[Candidate]:
    """Every (binding, grid point) of a resolved config's ``detectors`` list."""
    from stability.registry import detector_class, is_available

    grids = tune_grids() if grids is None else grids
    out = []
    for b, d in enumerate(detectors):
        det = d["detector"]
        if not is_available(det):
            continue
        cls = detector_class(det)
        args = _init_args(cls)
        base = {k: v for k, v in dict(d.get("params", {})).items() if k != "threshold"}
        tunable = "threshold" in args and not getattr(cls, "fixed_threshold", False)
        grid = dict(grids.get(det, {})) if tunable else {}
        grid = {k: v for k, v in grid.items() if k in args}
        keys = sorted(grid)
        for combo in itertools.product(*(grid[k] for k in keys)) if keys else [()]:
            p = dict(base)
            p.update(zip(keys, combo, strict=True))
            if tunable and "freeze_on_alarm" in args:
                p["freeze_on_alarm"] = False
            out.append(Candidate(b, d["name"], det, tuple(d["inputs"]),
                                 tuple(sorted(p.items())), tunable))
    return out


# ---------------------------------------------------------------------------- scoring jobs
@dataclass
class RunScores:
    """Per-step scores of every candidate on one run."""

    run_id: str
    steps: NDArray[np.int64]
    scores: list[FloatArray]


def _binder(candidates: Sequence[Candidate], aliases: Mapping[str, str]) -> Any:
    """A log-only monitor holding one binding per candidate binding: the monitor's own binder
    (:meth:`stability.monitor.Monitor.bind_table`) is what tuning scores are computed on."""
    from stability.monitor import Monitor

    dets: dict[str, dict[str, Any]] = {}
    for c in candidates:
        dets.setdefault(c.name, {"name": c.name, "detector": c.detector,
                                 "inputs": list(c.inputs), "params": c.params_dict()})
    return Monitor({"monitor": {"aliases": dict(aliases), "log_only": True},
                    "detectors": list(dets.values())}, alert_sinks=[])


def score_table(table: Any, candidates: Sequence[Candidate], aliases: Mapping[str, str],
                run_id: str = "") -> RunScores:
    """Compute every candidate's per-step score on one run table.

    The table is bound by the monitor's own binder, so a tuned threshold applies online to
    exactly the scores it was tuned on.
    """
    from stability.registry import make_detector

    steps, bound = _binder(candidates, aliases).bind_table(table)
    t = steps.size
    out: list[FloatArray] = []
    for c in candidates:
        x, m = bound[c.name]
        if t == 0 or x.shape[2] == 0:
            out.append(np.full(t, -np.inf))
            continue
        params = c.params_dict()
        if c.tunable:
            params["threshold"] = math.inf
        det = make_detector(c.detector, params, n_series=x.shape[2], n_inputs=x.shape[1],
                            where=c.name)
        scores, alarms = det.update_many(*[x[:, i, :] for i in range(x.shape[1])], missing=m)
        if c.tunable:
            out.append(reduce_series(scores))
        else:
            out.append(np.where(alarms.any(axis=1), np.inf, -np.inf))
    return RunScores(run_id, steps, out)


def _score_job(args: tuple[str, str, Sequence[Candidate], Mapping[str, str]]) -> RunScores:
    rid, path, cands, aliases = args
    return score_table(read_table(path, aliases), cands, aliases, rid)


def score_runs(runs: Sequence[tuple[str, str]], candidates: Sequence[Candidate],
               aliases: Mapping[str, str] | None = None, *, backend: str = "local",
               jobs: int | None = None, progress: bool | None = None) -> list[RunScores]:
    """Run the scoring jobs (one per run) locally in processes or on Ray."""
    al = dict(aliases or {})
    job_args = [(rid, path, list(candidates), al) for rid, path in runs]
    if backend == "local":
        return parallel_map(_score_job, job_args, jobs, "scoring", progress)
    if backend == "ray":
        return _score_ray(job_args, progress)
    raise ValueError(f"unknown backend {backend!r}; use 'local' or 'ray'.")


def _score_ray(job_args: list[Any], progress: bool | None) -> list[RunScores]:
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("backend 'ray' needs Ray: pip install 'ray'") from exc
    started = False
    if not ray.is_initialized():
        ray.init(include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
        started = True
    try:
        remote = ray.remote(_score_job)
        refs = [remote.remote(a) for a in job_args]
        bar = Progress(len(refs), "scoring (ray)", progress)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            bar.update(len(done))
        bar.close()
        return list(ray.get(refs))
    finally:
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------- search
@dataclass
class Choice:
    """The selected candidate and threshold of one binding (``None`` = binding dropped)."""

    cand: int
    threshold: float


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


class Tuner:
    """Greedy search over bindings on precomputed scores (see the module docstring)."""

    def __init__(self, scores: Sequence[RunScores], candidates: Sequence[Candidate],
                 labels: Mapping[str, RunLabel], budget: float,
                 settings: EvalSettings | None = None, n_thresholds: int = 1000):
        self.scores = list(scores)
        self.cands = list(candidates)
        self.labels = [labels.get(r.run_id, RunLabel(r.run_id)) for r in self.scores]
        self.budget = float(budget)
        self.es = settings or EvalSettings()
        self.n_thresholds = n_thresholds
        self.bindings = sorted({c.binding for c in self.cands})
        self.fixed = [i for i, c in enumerate(self.cands) if not c.tunable]
        self._mean_lead = math.nan

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

    def _best_for(self, rows: Sequence[int], b: int, choices: Mapping[int, Choice]
                  ) -> tuple[list[float], Choice] | None:
        best: tuple[list[float], Choice] | None = None
        for ci, c in enumerate(self.cands):
            if c.binding != b or not c.tunable:
                continue
            prof = self._profiles(rows, ci, choices, b)
            th = candidate_thresholds(prof, self.n_thresholds)
            sm = summarise_sweep(sweep(prof, th))
            ok = sm.fa_per_10k <= self.budget
            if sm.clean_steps == 0:
                ok = np.ones_like(ok)
            if not ok.any():
                continue
            keys = _objective_keys(sm.recall, sm.recall_before_divergence, sm.mean_lead,
                                   sm.recall_invisible, sm.fa_per_10k)
            idx = np.flatnonzero(ok)
            order = np.lexsort([k[idx] for k in reversed(keys)])
            j = int(idx[order[-1]])
            key = [float(k[j]) for k in keys]
            if best is None or key > best[0]:
                best = (key, Choice(ci, float(th[j])))
        return best

    def _key_of(self, s: Summary) -> list[float]:
        lead = self._mean_lead
        vals = [s.recall, s.recall_before_divergence, lead, s.recall_invisible, s.fa_per_10k]
        z = [(-1.0 if (isinstance(v, float) and math.isnan(v)) else float(v)) for v in vals]
        z[-1] = -z[-1]
        return z

    def search(self, rows: Sequence[int], max_rounds: int | None = None) -> dict[int, Choice]:
        """Greedy coordinate search on the runs ``rows``; returns ``binding -> Choice``."""
        choices: dict[int, Choice] = {}
        tunable_b = [b for b in self.bindings
                     if any(c.binding == b and c.tunable for c in self.cands)]
        rounds = max_rounds if max_rounds is not None else 2 * len(tunable_b) + 1
        current = self._score_choices(rows, choices)
        for _ in range(rounds):
            moves = []
            for b in tunable_b:
                r = self._best_for(rows, b, choices)
                if r is not None:
                    moves.append((r[0], b, r[1]))
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


@dataclass
class TuneResult:
    """Output of :func:`tune`: the config, the choices and the figures."""

    config: dict[str, Any]
    choices: list[dict[str, Any]]
    train: Summary
    heldout: Summary | None
    fold_figures: list[dict[str, float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def tune_scores(scores: Sequence[RunScores], candidates: Sequence[Candidate],
                labels: Mapping[str, RunLabel], base: Mapping[str, Any], budget: float, *,
                folds: int = 5, settings: EvalSettings | None = None,
                n_thresholds: int = 1000, seed: int = 0) -> TuneResult:
    """Tune on precomputed scores; ``base`` is the resolved config dict the result is built on."""
    t0 = time.perf_counter()
    tuner = Tuner(scores, candidates, labels, budget, settings, n_thresholds)
    all_rows = list(range(len(scores)))
    heldout: Summary | None = None
    fold_figs: list[dict[str, float]] = []
    if folds and folds > 1 and len(scores) >= folds:
        pooled: list[RunResult] = []
        for f in make_folds([s.run_id for s in scores], labels, folds, seed):
            train = [r for r in all_rows if r not in set(f)]
            fold_choices = tuner.search(train)
            s, res = tuner.evaluate(f, fold_choices)
            pooled.extend(res)
            fold_figs.append({"runs": len(f), "recall": s.recall, "fa_per_10k": s.fa_per_10k,
                              "recall_before_divergence": s.recall_before_divergence})
        heldout = summarise(pooled)
    t1 = time.perf_counter()
    choices = tuner.search(all_rows)
    train_summary = tuner.evaluate(all_rows, choices)[0]
    cfg = build_config(base, candidates, choices)
    desc = []
    for _, ch in sorted(choices.items()):
        c = candidates[ch.cand]
        desc.append({"binding": c.name, "detector": c.detector, "params": c.params_dict(),
                     "threshold": ch.threshold})
    return TuneResult(cfg, desc, train_summary, heldout, fold_figs,
                      {"cv": t1 - t0, "final": time.perf_counter() - t1})


def build_config(base: Mapping[str, Any], candidates: Sequence[Candidate],
                 choices: Mapping[int, Choice]) -> dict[str, Any]:
    """The base config with tuned bindings updated and unused tunable bindings removed."""
    cfg = copy.deepcopy(dict(base))
    cfg.pop("preset", None)
    dets = []
    tunable_b = {c.binding for c in candidates if c.tunable}
    for b, d in enumerate(cfg.get("detectors", [])):
        if b in choices:
            c = candidates[choices[b].cand]
            d = dict(d)
            d["params"] = {**c.params_dict(), "threshold": _round_up(choices[b].threshold)}
            dets.append(d)
        elif b not in tunable_b:
            dets.append(d)
    cfg["detectors"] = dets
    return cfg


def _round_up(x: float) -> float:
    """A float that prints in 10 significant digits and is >= ``x`` (alarms stay ``> x``)."""
    if not math.isfinite(x):
        return x
    y = float(f"{x:.10g}")
    if y < x:
        e = math.floor(math.log10(abs(x))) - 9 if x != 0 else 0
        y = float(f"{x + 10.0 ** e:.10g}")
    return y if y >= x else float(np.nextafter(x, math.inf))


# ---------------------------------------------------------------------------- TOML output
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _val(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        f = float(v)
        if math.isnan(f):
            return "nan"
        if math.isinf(f):
            return "inf" if f > 0 else "-inf"
        return repr(f)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, Mapping):
        if not v:
            return "{}"
        return "{ " + ", ".join(f"{_key(str(k))} = {_val(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    if v is None:
        raise ValueError("TOML has no null; drop the key instead.")
    raise ValueError(f"cannot write {v!r} as TOML.")


def _table_lines(prefix: str, d: Mapping[str, Any]) -> list[str]:
    scalars = [(k, v) for k, v in d.items() if not isinstance(v, Mapping) and v is not None]
    subs = [(k, v) for k, v in d.items() if isinstance(v, Mapping)]
    lines = [f"[{prefix}]"] if prefix else []
    lines += [f"{_key(str(k))} = {_val(v)}" for k, v in scalars]
    for k, v in subs:
        lines.append("")
        lines += _table_lines(f"{prefix}.{_key(str(k))}" if prefix else _key(str(k)), v)
    return lines


def to_toml(cfg: Mapping[str, Any], header: str = "") -> str:
    """Write a monitor config (``docs/CONTRACTS.md`` schema) as TOML.

    >>> print(to_toml({"monitor": {"aliases": {"train/loss": "loss"}, "log_only": False},
    ...                "detectors": [{"name": "l", "detector": "ewma_z", "inputs": ["loss"],
    ...                               "params": {"threshold": 6.0}}]}))
    [monitor]
    aliases = { "train/loss" = "loss" }
    log_only = false
    <BLANKLINE>
    [[detectors]]
    name = "l"
    detector = "ewma_z"
    inputs = ["loss"]
    params = { threshold = 6.0 }
    """
    lines = [f"# {h}" for h in header.splitlines()] if header else []
    if "preset" in cfg:
        lines.append(f"preset = {_val(cfg['preset'])}")
    if "monitor" in cfg:
        m = dict(cfg["monitor"])
        lines.append("[monitor]")
        lines += [f"{_key(k)} = {_val(v)}" for k, v in m.items() if v is not None]
    for d in cfg.get("detectors", []):
        lines += ["", "[[detectors]]"]
        lines += [f"{_key(k)} = {_val(v)}" for k, v in d.items() if v is not None]
    if cfg.get("policy"):
        lines.append("")
        lines += _table_lines("policy", cfg["policy"])
    return "\n".join(lines)


def write_config(path: str | os.PathLike[str], cfg: Mapping[str, Any], header: str = "") -> None:
    """Write ``cfg`` as TOML (``.toml``) or JSON (``.json``)."""
    p = Path(path)
    if p.suffix == ".json":
        p.write_text(json.dumps(cfg, indent=2) + "\n")
    else:
        p.write_text(to_toml(cfg, header) + "\n")


# ---------------------------------------------------------------------------- entry point
def tune(runs: Sequence[tuple[str, str]], labels: Mapping[str, RunLabel], budget: float, *,
         config: Any = None, folds: int = 5, backend: str = "local", jobs: int | None = None,
         settings: EvalSettings | None = None, grids: Mapping[str, Mapping[str, list[Any]]]
         | None = None, n_thresholds: int = 1000, progress: bool | None = None) -> TuneResult:
    """Score ``runs`` with every candidate of ``config``'s bindings and tune (module docstring).

    Parameters
    ----------
    runs
        ``(run_id, path)`` pairs; runs without a label count as clean.
    labels
        ``run_id -> RunLabel``.
    budget
        Maximum false alarms per 10k clean steps (union of all bindings).
    config
        Base monitor config (preset name, path, dict; ``None`` = the default preset).
    """
    from stability.config import load_config

    base = load_config(config).to_dict()
    t0 = time.perf_counter()
    cands = make_candidates(base["detectors"], grids)
    scores = score_runs(runs, cands, base.get("monitor", {}).get("aliases", {}),
                        backend=backend, jobs=jobs, progress=progress)
    t1 = time.perf_counter()
    res = tune_scores(scores, cands, labels, base, budget, folds=folds, settings=settings,
                      n_thresholds=n_thresholds)
    res.seconds["scoring"] = t1 - t0
    res.seconds["candidates"] = float(len(cands))
    return res
