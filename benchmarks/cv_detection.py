"""Cross-validated detection thresholds on the issue-14 benchmark (leave-one-out folds).

For each fold the detector thresholds are tuned on the training part with :mod:`replay.tuning`
(the engine of ``stability tune``): every binding of the base config is scored once per run
(scores cached for all folds), then the tuner's search maximises recall on visible faults under
the tuner's limits on the training part, long clean runs included: a false-alarm budget
(``--budget`` episodes per 10k clean steps), at most ``--max-clean-alarmed`` of the clean runs
alarmed, every move detecting ``--min-gain`` more faults, and (``--validate``, on by default)
every other training long run per architecture held back, the limits holding there too
(``--no-validate --hold-back F``: a random fraction of the clean runs instead, as ``stability
tune`` does). The tuned config is then replayed through the monitor
(:func:`replay.replay.alarms_for_eval`, what ``stability eval`` does) on the held-out part and
scored by :func:`replay.evaluate.evaluate_runs`, next to the untuned base preset on the same runs.

Folds (``--folds``):

* ``arch``: leave one architecture out (label column ``model``: 4 folds). Held out: every
  bench14 run of that architecture and its long clean runs; training: the other architectures'
  runs and long clean runs.
* ``class``: leave one fault class out (13 folds). Held out: the faulted runs of that class and
  half of the long clean runs (every other one per architecture); training: every other bench14
  run (all clean runs included) and the other half of the long runs.

Tuners (``--tuner``):

* ``greedy``: :meth:`replay.tuning.Tuner.search` as ``stability tune`` runs it -- bindings are
  switched on one at a time from nothing (full parameter grids unless ``--thresholds-only``).
* ``warm``: thresholds only, starting from the base preset's thresholds with every binding on; a
  move (the tuner's own best threshold for one binding) is accepted when it raises recall on
  visible faults and keeps the budget (``--objective project``: when it improves the tuner's
  whole objective, whose tie-breakers -- recall before divergence, lead, invisible faults -- also
  lower thresholds). A moved threshold is then put in the middle of the interval over which the
  training figures do not change (max margin instead of the edge of a clean score).

With several folds the ``warm`` thresholds give a consensus (median over the folds of every
binding's threshold), written by ``--write-consensus`` and replayed on every run.

Usage::

    python benchmarks/cv_detection.py                     # warm, recall, budget 0.5, 17 folds
    python benchmarks/cv_detection.py --max-clean-alarmed 1 --min-gain 0 --no-validate
                                                          # the tuner before issue 28's limits
    python benchmarks/cv_detection.py --write-consensus consensus.toml
    python benchmarks/cv_detection.py --tuner greedy --thresholds-only
    python benchmarks/cv_detection.py --quick             # 8 configurations, 4 long runs (tests)
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from replay.tuning import DEFAULT_MAX_CLEAN_ALARMED, DEFAULT_MIN_GAIN, Choice, Tuner

HERE = Path(__file__).resolve().parent
DEFAULT_SET = HERE / "data" / "bench14"
DEFAULT_LONG = HERE / "data" / "bench14_clean_long"
#: long clean small-batch SGD runs (issue 28: the runs whose natural spikes alarmed)
DEFAULT_SGD = HERE / "data" / "bench28_sgd_small"


class Fold(NamedTuple):
    """One fold: rows (indices into the run list, long runs last) to tune on and to hold out."""

    kind: str
    name: str
    train: list[int]
    test: list[int]


def _model(lab: Any) -> str:
    return "?" if lab is None else str(lab.extra.get("model", "?"))


def fold_rows(run_ids: Sequence[str], labels: Mapping[str, Any], kinds: Sequence[str], *,
              long_ids: Sequence[str] = (), max_class_folds: int | None = None) -> list[Fold]:
    """Every fold of every kind over ``run_ids`` (the benchmark runs) followed by ``long_ids``.

    Long runs of an architecture go with it in ``arch`` folds; in ``class`` folds every other
    long run of each architecture (sorted by id) is trained on, the rest held out. A long run
    without a ``model`` label is always held out (never tuned on).
    """
    n = len(run_ids)
    bench = list(range(n))
    longs = list(range(n, n + len(long_ids)))
    lab = {i: labels.get(rid) for i, rid in enumerate([*run_ids, *long_ids])}
    seen: dict[str, int] = {}
    long_train_half = set()
    for i in sorted(longs, key=lambda j: long_ids[j - n]):
        m = _model(lab[i])
        if m != "?" and seen.get(m, 0) % 2 == 0:
            long_train_half.add(i)
        seen[m] = seen.get(m, 0) + 1
    out = []
    if "arch" in kinds:
        for a in sorted({_model(lab[i]) for i in bench if lab[i] is not None}):
            test = [i for i in bench if lab[i] is not None and _model(lab[i]) == a]
            ts = set(test)
            ltest = [i for i in longs if _model(lab[i]) in (a, "?")]
            out.append(Fold("arch", a, [i for i in bench if i not in ts]
                            + [i for i in longs if i not in set(ltest)], test + ltest))
    if "class" in kinds:
        classes = sorted({lab[i].scenario for i in bench
                          if lab[i] is not None and not lab[i].is_clean})
        for c in classes[:max_class_folds]:
            test = [i for i in bench
                    if lab[i] is not None and not lab[i].is_clean and lab[i].scenario == c]
            ts = set(test)
            out.append(Fold("class", c, [i for i in bench if i not in ts] + sorted(long_train_half),
                            test + [i for i in longs if i not in long_train_half]))
    return out


# ---------------------------------------------------------------------------- warm-start tuner
def base_thresholds(base_cfg: Mapping[str, Any], cands: Sequence[Any]) -> dict[int, float]:
    """``binding -> threshold`` of the base config (the detector's default when not set)."""
    from stability.config.registry import detector_class

    out = {}
    for c in cands:
        if not c.tunable or c.binding in out:
            continue
        params = base_cfg["detectors"][c.binding].get("params", {})
        if "threshold" in params:
            out[c.binding] = float(params["threshold"])
        else:
            sig = inspect.signature(detector_class(c.detector).__init__)  # type: ignore[misc]
            out[c.binding] = float(sig.parameters["threshold"].default)
    return out


class WarmTuner(Tuner):
    """The project's tuner started from the base thresholds, with a max-margin final step.

    Uses the tuner's own move generator (``_best_for``) and objective, on the same cached
    scores; only the start point, the budget check of the start point and the final placement
    of a moved threshold differ from :meth:`replay.tuning.Tuner.search`. ``recall_only``
    accepts a move only when it raises recall on visible faults (or restores the budget), not
    for the tuner's tie-breakers (recall before divergence, lead, invisible faults).
    """

    def __init__(self, *args: Any, start: Mapping[int, float], recall_only: bool = False,
                 **kw: Any):
        super().__init__(*args, **kw)
        self.recall_only = recall_only
        self.start = {b: Choice(next(i for i, c in enumerate(self.cands)
                                     if c.binding == b and c.tunable), th)
                      for b, th in start.items()}

    def search(self, rows: Sequence[int], max_rounds: int | None = None, *,
               val: Sequence[int] = ()) -> dict[int, Choice]:
        """Moves from the start point on ``rows``; with ``val`` (runs never tuned on), a move
        must keep the false-alarm budget and the clean-run limit there too."""
        choices = dict(self.start)
        tunable_b = sorted(self.start)
        rounds = max_rounds if max_rounds is not None else 2 * len(tunable_b) + 1
        current = self._score_choices(rows, choices)
        feasible = self._keeps_limits(rows, choices)
        if not feasible:  # the start point breaks a limit: any feasible move
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
        return not (s.fa_per_10k > self.budget or s.clean_runs_alarmed > self.max_clean_alarmed)

    def _widen(self, rows: Sequence[int], b: int, choices: Mapping[int, Choice]) -> float:
        """Middle of ``[th, next breakpoint)``: every training figure is the same there."""
        from replay.scoring import candidate_thresholds

        th = choices[b].threshold
        prof = self._profiles(rows, choices[b].cand, choices, b)
        v = candidate_thresholds(prof, 10**9)
        above = v[v > th]
        nxt = float(above[0]) if above.size else math.inf
        if not math.isfinite(th) or not math.isfinite(nxt):
            return th
        return math.sqrt(th * nxt) if th > 0 else 0.5 * (th + nxt)


# ---------------------------------------------------------------------------- cross-validation
@dataclass
class FoldResult:
    """Figures of one fold: tuned and base config on the held-out part (long runs included)."""

    kind: str
    name: str
    n_train: int
    n_test: int
    tuned: Any  # replay.evaluate.Summary, held-out part incl. long runs
    base: Any
    tuned_long: Any  # the held-out long runs only
    base_long: Any
    results: dict[str, list[Any]] = field(default_factory=dict)  # RunResults for pooling
    changes: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)  # binding -> tuned threshold


def _describe_changes(base: Mapping[str, Any], tuned: Mapping[str, Any],
                      start: Mapping[str, float] | None = None) -> list[str]:
    """Human-readable differences of the detector bindings (``name: param a -> b``).

    ``start`` gives the thresholds of bindings whose base config leaves it at its default.
    """
    start = start or {}
    old = {d["name"]: d for d in base.get("detectors", [])}
    new = {d["name"]: d for d in tuned.get("detectors", [])}
    out = []
    for name, d in old.items():
        if name not in new:
            out.append(f"{name}: dropped")
            continue
        po, pn = dict(d.get("params", {})), dict(new[name].get("params", {}))
        if "threshold" not in po and name in start:
            po["threshold"] = start[name]
        diffs = [f"{k} {po.get(k)!r}->{_g(pn.get(k))}" for k in sorted(set(po) | set(pn))
                 if po.get(k) != pn.get(k) and k != "freeze_on_alarm"]
        if diffs:
            out.append(f"{name}: " + ", ".join(diffs))
    return out


def _g(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else repr(v)


def _hold_back_long(rows: Sequence[int], run_ids: Sequence[str], labels: Mapping[str, Any],
                    n_bench: int) -> tuple[list[int], list[int]]:
    """Split ``rows`` into (tune, validate): every other long run (row >= ``n_bench``) of each
    architecture, sorted by id, goes to validate."""
    seen: dict[str, int] = {}
    tune, val = [], []
    for i in sorted(rows, key=lambda j: (j < n_bench, run_ids[j])):
        if i < n_bench:
            tune.append(i)
            continue
        m = _model(labels.get(run_ids[i]))
        (val if seen.get(m, 0) % 2 else tune).append(i)
        seen[m] = seen.get(m, 0) + 1
    return sorted(tune), sorted(val)


def _replay(config: Any, runs: Sequence[tuple[str, str]], labels: Mapping[str, Any],
            window: int, jobs: int | None) -> dict[str, Any]:
    """``run_id -> RunResult`` of ``config`` replayed through the monitor."""
    from replay.evaluate import evaluate_runs
    from replay.replay import alarms_for_eval

    if not runs:
        return {}
    steps, alarms = alarms_for_eval(runs, config, jobs=jobs, progress=False)
    return {r.run_id: r for r in evaluate_runs(alarms["ours"], steps, labels, window=window)[1]}


def cross_validate(runs: Sequence[tuple[str, str]], labels: Mapping[str, Any],
                   long_runs: Sequence[tuple[str, str]], *, base: Any = "default",
                   budget: float = 0.5, kinds: Sequence[str] = ("arch", "class"),
                   tuner: str = "warm", objective: str = "recall",
                   thresholds_only: bool = False, window: int = 200,
                   n_thresholds: int = 1000, jobs: int | None = 1,
                   max_class_folds: int | None = None, validate: bool = False,
                   max_clean_alarmed: float = DEFAULT_MAX_CLEAN_ALARMED,
                   min_gain: int = DEFAULT_MIN_GAIN, hold_back_clean: float = 0.0,
                   progress: bool = False) -> tuple[list[FoldResult], dict[str, Any]]:
    """Tune on each fold's training part, replay tuned and base config on its held-out part.

    ``labels`` covers the benchmark and the long runs (a run without a label counts as clean).
    ``validate``: every other training long run per architecture is not tuned on
    but checks each move (the budget and ``max_clean_alarmed`` must hold there too).
    ``max_clean_alarmed``: the tuner's limit on the fraction of training clean runs alarmed
    (1 = the false-alarm budget alone, the tuner before issue 28's round 3); ``min_gain``: the
    fewest additional training faults a move must detect (0 = any gain).
    ``hold_back_clean`` (without ``validate``): hold back that fraction of the training clean
    runs instead, drawn at random (:func:`replay.tuning.hold_back`, what ``stability tune``
    does).

    Returns
    -------
    folds, extra
        One :class:`FoldResult` per fold; ``extra`` holds the resolved base config
        (``"base_config"``), the candidates, the tuner, the base results per run and the
        seconds spent (``"seconds"``).
    """
    from replay.evaluate import summarise
    from replay.tuning import EvalSettings, build_config, hold_back, make_candidates, score_runs
    from stability.config.config import load_config

    t0 = time.perf_counter()
    base_cfg = load_config(base).to_dict()
    warm = tuner == "warm"
    cands = make_candidates(base_cfg["detectors"], {} if (thresholds_only or warm) else None)
    aliases = base_cfg.get("monitor", {}).get("aliases", {})
    all_runs = [*runs, *long_runs]
    scores = score_runs(all_runs, cands, aliases, jobs=jobs, progress=False)
    run_ids = [s.run_id for s in scores]
    t_score = time.perf_counter() - t0
    es = EvalSettings(window=window)
    tn: Tuner
    start = base_thresholds(base_cfg, cands)
    start_by_name = {base_cfg["detectors"][b]["name"]: th for b, th in start.items()}
    if warm:
        tn = WarmTuner(scores, cands, labels, budget, es, n_thresholds, start=start,
                       recall_only=objective == "recall", max_clean_alarmed=max_clean_alarmed,
                       min_gain=min_gain)
    else:
        tn = Tuner(scores, cands, labels, budget, es, n_thresholds,
                   max_clean_alarmed=max_clean_alarmed, min_gain=min_gain)
    by_id = dict(all_runs)
    long_set = {rid for rid, _ in long_runs}
    base_res = _replay(base, all_runs, labels, window, jobs)
    out = []
    for f in fold_rows([r for r, _ in runs], labels, kinds, long_ids=[r for r, _ in long_runs],
                       max_class_folds=max_class_folds):
        train, val = f.train, []
        if validate:
            train, val = _hold_back_long(f.train, run_ids, labels, len(runs))
        elif hold_back_clean:
            train, val = hold_back(run_ids, labels, f.train, hold_back_clean)
        choices = tn.search(train, val=val)
        cfg = build_config(base_cfg, cands, choices)
        test_ids = [run_ids[i] for i in f.test]
        res = _replay(cfg, [(r, by_id[r]) for r in test_ids], labels, window, jobs)
        tuned = [res[r] for r in test_ids]
        bres = [base_res[r] for r in test_ids]
        ths = {cands[ch.cand].name: ch.threshold for ch in choices.values()}
        for b in {c.binding for c in cands if c.tunable} - set(choices):
            ths[base_cfg["detectors"][b]["name"]] = math.inf  # dropped binding
        fr = FoldResult(
            f.kind, f.name, len(f.train), len(f.test), summarise(tuned), summarise(bres),
            summarise([r for r in tuned if r.run_id in long_set]),
            summarise([r for r in bres if r.run_id in long_set]),
            {"tuned": tuned, "base": bres}, _describe_changes(base_cfg, cfg, start_by_name), ths)
        out.append(fr)
        if progress:
            print(f"  fold {f.kind}={f.name}: recall visible tuned {_pct(fr.tuned.recall)} "
                  f"base {_pct(fr.base.recall)}; FA/10k tuned {_fa(fr.tuned.fa_per_10k)} "
                  f"base {_fa(fr.base.fa_per_10k)} ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    extra = {"base_config": base_cfg, "start": start_by_name, "candidates": cands, "tuner": tn,
             "base_results": base_res,
             "seconds": {"scoring": t_score, "total": time.perf_counter() - t0}}
    return out, extra


def consensus_config(base_cfg: Mapping[str, Any], folds: Sequence[FoldResult],
                     digits: int = 3) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The base config with every tuned binding's threshold set to its median over ``folds``.

    Rounded to ``digits`` significant digits; a binding dropped in most folds (median ``inf``)
    is left out. Returns the config and ``binding -> per-fold thresholds``.
    """
    per: dict[str, list[float]] = {}
    for f in folds:
        for name, th in f.thresholds.items():
            per.setdefault(name, []).append(th)
    cfg = copy.deepcopy(dict(base_cfg))
    cfg.pop("preset", None)
    dets = []
    for d in cfg.get("detectors", []):
        if d["name"] in per:
            med = float(np.median(per[d["name"]]))
            if not math.isfinite(med):
                continue
            d = {**d, "params": {**dict(d.get("params", {})),
                                 "threshold": float(f"{med:.{digits}g}")}}
        dets.append(d)
    cfg["detectors"] = dets
    return cfg, per


# ---------------------------------------------------------------------------- output
def _pct(v: float) -> str:
    return "-" if isinstance(v, float) and math.isnan(v) else f"{100 * v:.0f}%"


def _fa(v: float) -> str:
    return "-" if isinstance(v, float) and math.isnan(v) else f"{v:.2f}"


def _d(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.0f}"


def _row(s: Any, b: Any) -> str:
    return (f"{_pct(s.recall)} / {_pct(b.recall)} | {_pct(s.recall_all)} / {_pct(b.recall_all)} "
            f"| {_d(s.median_delay)} / {_d(b.median_delay)} | "
            f"{_pct(s.recall_before_divergence)} / {_pct(b.recall_before_divergence)} | "
            f"{_fa(s.fa_per_10k)} / {_fa(b.fa_per_10k)}")


_HEAD = ("recall@W visible | all | median delay | alarm before failure | FA/10k clean steps "
         "(incl. long)")


def format_folds(folds: Sequence[FoldResult]) -> str:
    """A markdown table: per fold, tuned / base on the held-out part."""
    lines = [f"| fold | held-out runs (faulty, visible; long) | {_HEAD} | FA/10k long only |",
             "|---|---|---|---|---|---|---|---|"]
    for f in folds:
        lines.append(
            f"| {f.kind}={f.name} | {f.n_test} ({f.tuned.n_faulty}, {f.tuned.n_visible}; "
            f"{f.tuned_long.n_runs}) | {_row(f.tuned, f.base)} | "
            f"{_fa(f.tuned_long.fa_per_10k)} / {_fa(f.base_long.fa_per_10k)} |")
    return "\n".join(lines)


def pooled(folds: Sequence[FoldResult], kind: str) -> dict[str, Any]:
    """Pooled held-out summaries of one fold kind: ``tuned``, ``base``, ``n_folds``."""
    from replay.evaluate import summarise

    fs = [f for f in folds if f.kind == kind]
    return {"tuned": summarise([r for f in fs for r in f.results["tuned"]]),
            "base": summarise([r for f in fs for r in f.results["base"]]), "n_folds": len(fs)}


def format_pooled(folds: Sequence[FoldResult]) -> str:
    """Pooled held-out figures per fold kind (markdown; tuned / base)."""
    lines = [f"| folds | {_HEAD} | invisible | clean runs alarmed |", "|---|---|---|---|---|---|"
             "---|---|"]
    for kind in ("arch", "class"):
        p = pooled(folds, kind)
        if p["n_folds"]:
            t, b = p["tuned"], p["base"]
            lines.append(f"| {kind} ({p['n_folds']}) | {_row(t, b)} | "
                         f"{_pct(t.recall_invisible)} / {_pct(b.recall_invisible)} | "
                         f"{_pct(t.clean_runs_alarmed)} / {_pct(b.clean_runs_alarmed)} |")
    return "\n".join(lines)


def format_thresholds(per: Mapping[str, Sequence[float]], start: Mapping[str, float],
                      cons: Mapping[str, Any]) -> str:
    """Per binding: base threshold (``start``), per-fold range, median (consensus)."""
    bt = dict(start)
    ct = {d["name"]: d.get("params", {}).get("threshold") for d in cons["detectors"]}
    lines = ["| binding | base | folds min .. max | folds moved | consensus |",
             "|---|---|---|---|---|"]
    for name, v in per.items():
        moved = sum(1 for x in v if bt.get(name) is None or x != bt[name])
        lines.append(f"| {name} | {_g(bt.get(name))} | {_g(min(v))} .. {_g(max(v))} | "
                     f"{moved}/{len(v)} | {_g(ct.get(name, math.inf))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    from replay.evaluate import summarise
    from replay.labels import load_labels
    from replay.replay import discover_runs
    from replay.tuning import write_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=str(DEFAULT_SET / "runs"), help="folder (or glob) of runs")
    p.add_argument("--labels", default=None,
                   help="labels file (default: labels.parquet next to the runs folder)")
    p.add_argument("--long", default=",".join(str(d / "runs" / "*.parquet")
                                              for d in (DEFAULT_LONG, DEFAULT_SGD)),
                   help="comma-separated folders (or globs) of long clean runs ('' for none)")
    p.add_argument("--long-labels", default=",".join(str(d / "labels.parquet")
                                                     for d in (DEFAULT_LONG, DEFAULT_SGD)),
                   help="their labels, comma-separated (architecture in column 'model'; "
                        "missing = held out)")
    p.add_argument("--base", default="default", help="base config / preset (default %(default)s)")
    p.add_argument("--tuner", choices=("warm", "greedy"), default="warm",
                   help="warm: from the base thresholds (default); greedy: stability tune's")
    p.add_argument("--objective", choices=("recall", "project"), default="recall",
                   help="warm: accept a move only when recall on visible faults rises (recall, "
                        "default) or by the tuner's whole objective (project)")
    p.add_argument("--budget", type=float, default=0.5, help="false alarms per 10k clean steps")
    p.add_argument("--max-clean-alarmed", type=float, default=DEFAULT_MAX_CLEAN_ALARMED,
                   help="most clean training runs with any alarm episode, as a fraction "
                        "(default %(default)s; 1 = the budget alone)")
    p.add_argument("--min-gain", type=int, default=DEFAULT_MIN_GAIN,
                   help="fewest additional training faults a move must detect (default "
                        "%(default)s = any gain)")
    p.add_argument("--folds", default="arch,class", help="fold kinds: arch, class")
    p.add_argument("--window", type=int, default=200, help="detection window (recall@W)")
    p.add_argument("--thresholds", type=int, default=1000, help="thresholds per candidate")
    p.add_argument("--jobs", type=int, default=1,
                   help="processes (default 1: every process compiles the detectors)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny run: configurations 0-7 of the set, 4 long runs, arch folds "
                        "and 3 class folds, 100 thresholds")
    p.add_argument("--thresholds-only", action="store_true",
                   help="greedy: tune thresholds only (no parameter grid; warm always is)")
    p.add_argument("--validate", action=argparse.BooleanOptionalAction, default=True,
                   help="hold back every other training long run per architecture; a move must "
                        "keep the budget and --max-clean-alarmed there too (default: on)")
    p.add_argument("--hold-back", type=float, default=0.0,
                   help="with --no-validate: hold back this fraction of the training clean "
                        "runs, at random (stability tune's --hold-back)")
    p.add_argument("--write-consensus", default=None,
                   help="write the median-over-folds config here (.toml / .json) and replay it")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    a = p.parse_args(argv)
    runs = discover_runs(a.runs)
    if not runs:
        p.error(f"no runs found at {a.runs!r}")
    labels_path = Path(a.labels) if a.labels else Path(a.runs).parent / "labels.parquet"
    labels = dict(load_labels(labels_path))
    long_runs = [r for g in a.long.split(",") if g for r in discover_runs(g)]
    for lp in (x for x in a.long_labels.split(",") if x):
        if long_runs and Path(lp).exists():
            labels.update(load_labels(lp))
    kinds = [k for k in a.folds.split(",") if k]
    if a.quick:
        keep = {f"bench_{i:03d}_" for i in range(8)}
        runs = [r for r in runs if r[0][:10] in keep]
        long_runs = long_runs[:4]
        a.thresholds = min(a.thresholds, 100)
    t0 = time.perf_counter()
    folds, extra = cross_validate(runs, labels, long_runs, base=a.base, budget=a.budget,
                                  kinds=kinds, tuner=a.tuner, objective=a.objective,
                                  thresholds_only=a.thresholds_only,
                                  window=a.window, n_thresholds=a.thresholds, jobs=a.jobs,
                                  max_class_folds=3 if a.quick else None,
                                  validate=a.validate, max_clean_alarmed=a.max_clean_alarmed,
                                  min_gain=a.min_gain, hold_back_clean=a.hold_back,
                                  progress=not a.quick)
    base_cfg = extra["base_config"]
    held = (f", {a.hold_back:.0%} of clean runs held back"
            if a.hold_back and not a.validate else "")
    grid = "thresholds only" if (a.thresholds_only or a.tuner == "warm") else "thresholds + grid"
    print(f"{len(runs)} runs from {a.runs}; {len(long_runs)} long clean runs from "
          f"{a.long or '-'}; base {a.base}; tuner {a.tuner} ({grid}"
          f"{', objective ' + a.objective if a.tuner == 'warm' else ''}"
          f"{', validated on held-back long runs' if a.validate else ''}"
          f"{held}); budget {a.budget} "
          f"FA/10k and at most {a.max_clean_alarmed:.0%} of clean runs alarmed on the training "
          f"part; moves gain >= {max(a.min_gain, 1)} faults; window {a.window}")
    print(f"\nper fold, tuned / {a.base} on the held-out part:")
    print(format_folds(folds))
    print("\npooled held-out (class folds: the held-out long half counted once per fold):")
    print(format_pooled(folds))
    print("\ntuned-config changes per fold (vs base):")
    for f in folds:
        print(f"  {f.kind}={f.name}: " + ("; ".join(f.changes) or "none"))
    cons, per = consensus_config(base_cfg, folds)
    print(f"\nthresholds over the {len(folds)} folds (consensus = median):")
    print(format_thresholds(per, extra["start"], cons))
    doc: dict[str, Any] = {
        "runs": a.runs, "long": a.long, "base": a.base, "budget": a.budget,
        "max_clean_alarmed": a.max_clean_alarmed, "min_gain": a.min_gain,
        "hold_back": 0.0 if a.validate else a.hold_back, "tuner": a.tuner,
        "objective": a.objective, "validate": a.validate, "window": a.window,
        "thresholds_only": a.thresholds_only or a.tuner == "warm",
        "folds": [{"kind": f.kind, "name": f.name, "n_train": f.n_train, "n_test": f.n_test,
                   "tuned": f.tuned.to_dict(), "base": f.base.to_dict(),
                   "tuned_long": f.tuned_long.to_dict(), "base_long": f.base_long.to_dict(),
                   "changes": f.changes, "thresholds": f.thresholds} for f in folds],
        "pooled": {k: {n: (s.to_dict() if hasattr(s, "to_dict") else s)
                       for n, s in pooled(folds, k).items()} for k in kinds},
        "consensus_thresholds": {d["name"]: d["params"]["threshold"] for d in cons["detectors"]
                                 if d["name"] in per},
    }
    if a.write_consensus:
        write_config(a.write_consensus, cons,
                     f"consensus (median over {len(folds)} folds) of benchmarks/cv_detection.py "
                     f"--tuner {a.tuner} --objective {a.objective}{' --validate' * a.validate}, "
                     f"budget {a.budget} FA/10k, max clean alarmed {a.max_clean_alarmed}, "
                     f"base {a.base}\n")
        all_runs = [*runs, *long_runs]
        res = _replay(str(a.write_consensus), all_runs, labels, a.window, a.jobs)
        bres = extra["base_results"]
        long_ids = {r for r, _ in long_runs}
        rows = {"consensus": summarise(res.values()), a.base: summarise(bres.values())}
        rows_l = {"consensus": summarise(v for k, v in res.items() if k in long_ids),
                  a.base: summarise(v for k, v in bres.items() if k in long_ids)}
        print(f"\nconsensus -> {a.write_consensus}, replayed on every run (NOT held out: "
              "the folds' training parts cover all of them):")
        print(f"| config | {_HEAD} | FA/10k long only |\n|---|---|---|---|---|---|---|")
        for n in rows:
            s = rows[n]
            print(f"| {n} | {_pct(s.recall)} | {_pct(s.recall_all)} | {_d(s.median_delay)} | "
                  f"{_pct(s.recall_before_divergence)} | {_fa(s.fa_per_10k)} | "
                  f"{_fa(rows_l[n].fa_per_10k)} |")
        doc["consensus_replay"] = {n: s.to_dict() for n, s in rows.items()}
    secs = extra["seconds"]
    print(f"\nscoring {secs['scoring']:.0f} s, total {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=lambda x: None)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
