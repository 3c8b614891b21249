"""Cross-validated detection thresholds on the issue-14 benchmark (leave-one-out folds).

For each fold the detector thresholds (and the grid parameters of the tunable detectors) are
tuned on the training part with :mod:`replay.tuning` -- the engine of ``stability tune``: every
binding of the base config is scored once per run, then the greedy threshold search runs under
a false-alarm budget (``--budget`` false-alarm episodes per 10k clean steps) on the training
rows only. The tuned config (:func:`replay.tuning.build_config`) is then replayed through the
monitor (:func:`replay.replay.alarms_for_eval`, what ``stability eval`` does) on the held-out
part and on a set of long clean runs (never tuned on), and scored by
:func:`replay.evaluate.evaluate_runs`. The base preset is replayed on the same runs for
comparison.

Folds:

* ``arch``: leave one architecture out (label column ``model``: 4 folds); the held-out part is
  every run of that architecture, clean runs included (held-out FA/10k from them);
* ``class``: leave one fault class out (label column ``scenario``: 13 folds); the held-out part
  is the faulted runs of that class, training is every other run (all clean runs included), so
  the held-out false-alarm figure comes from the long clean runs only.

Usage::

    python benchmarks/cv_detection.py                     # bench14 + bench14_clean_long
    python benchmarks/cv_detection.py --budget 0.5 --folds arch,class --write-tuned tuned.toml
    python benchmarks/cv_detection.py --quick             # 8 configurations, 4 long runs (tests)

``--write-tuned`` also tunes on every run of the benchmark and writes that config (for the final
checks on the shared public runs and real logs with ``stability eval --config``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_SET = HERE / "data" / "bench14"
DEFAULT_LONG = HERE / "data" / "bench14_clean_long"


@dataclass
class FoldResult:
    """Figures of one fold: tuned and base config on the held-out part and the long runs."""

    kind: str
    name: str
    n_train: int
    n_test: int
    tuned: Any  # replay.evaluate.Summary
    base: Any
    tuned_long: Any
    base_long: Any
    results: dict[str, list[Any]] = field(default_factory=dict)  # RunResults for pooling
    changes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


def _fold_rows(run_ids: Sequence[str], labels: Mapping[str, Any], kinds: Sequence[str],
               max_class_folds: int | None = None) -> list[tuple[str, str, list[int], list[int]]]:
    """``(kind, name, train_rows, test_rows)`` for every fold of every kind."""
    def lab(i: int) -> Any:
        return labels.get(run_ids[i])

    rows = list(range(len(run_ids)))
    out = []
    if "arch" in kinds:
        archs = sorted({str(lab(i).extra.get("model")) for i in rows if lab(i) is not None})
        for a in archs:
            test = [i for i in rows if lab(i) is not None and str(lab(i).extra.get("model")) == a]
            out.append(("arch", a, [i for i in rows if i not in set(test)], test))
    if "class" in kinds:
        classes = sorted({lab(i).scenario for i in rows
                          if lab(i) is not None and not lab(i).is_clean})
        for c in classes[:max_class_folds]:
            test = [i for i in rows
                    if lab(i) is not None and not lab(i).is_clean and lab(i).scenario == c]
            out.append(("class", c, [i for i in rows if i not in set(test)], test))
    return out


def _describe_changes(base: Mapping[str, Any], tuned: Mapping[str, Any]) -> list[str]:
    """Human-readable differences of the detector bindings (``name: param a -> b``)."""
    old = {d["name"]: d for d in base.get("detectors", [])}
    new = {d["name"]: d for d in tuned.get("detectors", [])}
    out = []
    for name, d in old.items():
        if name not in new:
            out.append(f"{name}: dropped")
            continue
        po, pn = dict(d.get("params", {})), dict(new[name].get("params", {}))
        diffs = [f"{k} {po.get(k)!r}->{pn.get(k)!r}" for k in sorted(set(po) | set(pn))
                 if po.get(k) != pn.get(k) and k != "freeze_on_alarm"]
        if diffs:
            out.append(f"{name}: " + ", ".join(diffs))
    return out


def _eval(config: Any, runs: Sequence[tuple[str, str]], labels: Mapping[str, Any],
          window: int, jobs: int | None) -> tuple[Any, list[Any]]:
    from replay.evaluate import evaluate_runs
    from replay.replay import alarms_for_eval

    if not runs:
        from replay.evaluate import summarise

        return summarise([]), []
    steps, alarms = alarms_for_eval(runs, config, jobs=jobs, progress=False)
    return evaluate_runs(alarms["ours"], steps, labels, window=window)


def cross_validate(runs: Sequence[tuple[str, str]], labels: Mapping[str, Any],
                   long_runs: Sequence[tuple[str, str]], *, base: Any = "default",
                   budget: float = 0.5, kinds: Sequence[str] = ("arch", "class"),
                   window: int = 200, n_thresholds: int = 1000, jobs: int | None = 1,
                   max_class_folds: int | None = None, thresholds_only: bool = False,
                   long_train: bool = False, progress: bool = False
                   ) -> tuple[list[FoldResult], dict[str, Any]]:
    """Tune on each fold's training part, replay tuned and base config on its held-out part.

    ``thresholds_only`` keeps every binding's parameters and tunes its threshold only (no
    parameter grid). ``long_train`` puts every other long clean run (the 1st, 3rd, ...) into
    every fold's training part, so the false-alarm budget also sees long clean stretches; the
    long-run figures then come from the other half only.

    Returns
    -------
    folds, extra
        One :class:`FoldResult` per fold; ``extra`` holds the resolved base config
        (``"base_config"``), the scores and candidates (``"scores"``, ``"candidates"``) and the
        seconds spent (``"seconds"``).
    """
    from replay.tuning import EvalSettings, Tuner, build_config, make_candidates, score_runs
    from stability.config import load_config

    t0 = time.perf_counter()
    base_cfg = load_config(base).to_dict()
    cands = make_candidates(base_cfg["detectors"], {} if thresholds_only else None)
    aliases = base_cfg.get("monitor", {}).get("aliases", {})
    scores = score_runs(runs, cands, aliases, jobs=jobs, progress=False)
    run_ids = [s.run_id for s in scores]
    long_rows: list[int] = []
    if long_train:
        long_tr, long_runs = list(long_runs[::2]), list(long_runs[1::2])
        long_scores = score_runs(long_tr, cands, aliases, jobs=jobs, progress=False)
        long_rows = list(range(len(scores), len(scores) + len(long_scores)))
        scores = [*scores, *long_scores]
    t_score = time.perf_counter() - t0
    es = EvalSettings(window=window)
    tuner = Tuner(scores, cands, labels, budget, es, n_thresholds)
    by_id = dict(runs)
    # the base config once on everything (subsets below)
    base_all, base_res = _eval(base, runs, labels, window, jobs)
    base_by_id = {r.run_id: r for r in base_res}
    base_long, _ = _eval(base, long_runs, {}, window, jobs)
    from replay.evaluate import summarise

    out = []
    for kind, name, train, test in _fold_rows(run_ids, labels, kinds,
                                                     max_class_folds):
        choices = tuner.search([*train, *long_rows])
        cfg = build_config(base_cfg, cands, choices)
        test_runs = [(run_ids[i], by_id[run_ids[i]]) for i in test]
        tuned, tuned_res = _eval(cfg, test_runs, labels, window, jobs)
        tuned_long, long_res = _eval(cfg, long_runs, {}, window, jobs)
        bres = [base_by_id[run_ids[i]] for i in test]
        fr = FoldResult(kind, name, len(train), len(test), tuned, summarise(bres), tuned_long,
                        base_long, {"tuned": tuned_res, "base": bres, "tuned_long": long_res},
                        _describe_changes(base_cfg, cfg), cfg)
        out.append(fr)
        if progress:
            print(f"  fold {kind}={name}: tuned recall {tuned.recall_all:.2f} "
                  f"base {fr.base.recall_all:.2f}", file=sys.stderr, flush=True)
    extra = {"base_config": base_cfg, "scores": scores, "candidates": cands, "tuner": tuner,
             "base_all": base_all, "seconds": {"scoring": t_score,
                                               "total": time.perf_counter() - t0}}
    return out, extra


def _pct(v: float) -> str:
    return "-" if isinstance(v, float) and math.isnan(v) else f"{100 * v:.0f}%"


def _fa(v: float) -> str:
    return "-" if isinstance(v, float) and math.isnan(v) else f"{v:.2f}"


def format_folds(folds: Sequence[FoldResult]) -> str:
    """A markdown table: per fold, tuned vs base (recall@W visible / all, FA/10k, long FA)."""
    head = ("| fold | held-out runs (faulty) | recall visible tuned / base | recall all tuned / "
            "base | FA/10k held-out tuned / base | FA/10k long clean tuned / base |")
    lines = [head, "|---|---|---|---|---|---|"]
    for f in folds:
        lines.append(
            f"| {f.kind}={f.name} | {f.n_test} ({f.tuned.n_faulty}) | "
            f"{_pct(f.tuned.recall)} / {_pct(f.base.recall)} | "
            f"{_pct(f.tuned.recall_all)} / {_pct(f.base.recall_all)} | "
            f"{_fa(f.tuned.fa_per_10k)} / {_fa(f.base.fa_per_10k)} | "
            f"{_fa(f.tuned_long.fa_per_10k)} / {_fa(f.base_long.fa_per_10k)} |")
    return "\n".join(lines)


def pooled(folds: Sequence[FoldResult], kind: str) -> dict[str, Any]:
    """Pooled held-out summaries of one fold kind: ``tuned``, ``base``, ``tuned_long``."""
    from replay.evaluate import summarise

    fs = [f for f in folds if f.kind == kind]
    return {"tuned": summarise([r for f in fs for r in f.results["tuned"]]),
            "base": summarise([r for f in fs for r in f.results["base"]]),
            "tuned_long": summarise([r for f in fs for r in f.results["tuned_long"]]),
            "base_long": fs[0].base_long if fs else None, "n_folds": len(fs)}


def format_pooled(folds: Sequence[FoldResult]) -> str:
    """Pooled held-out figures per fold kind (markdown)."""
    lines = ["| folds | config | recall visible | recall all | invisible | before failure "
             "| median delay | FA/10k held-out | FA/10k long clean (all folds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("arch", "class"):
        p = pooled(folds, kind)
        if not p["n_folds"]:
            continue
        for name, s, sl in (("tuned", p["tuned"], p["tuned_long"]),
                            ("base", p["base"], p["base_long"])):
            md = s.median_delay
            lines.append(
                f"| {kind} ({p['n_folds']}) | {name} | {_pct(s.recall)} ({s.n_visible}) | "
                f"{_pct(s.recall_all)} ({s.n_faulty}) | {_pct(s.recall_invisible)} | "
                f"{_pct(s.recall_before_divergence)} | "
                f"{'-' if math.isnan(md) else f'{md:.0f}'} | {_fa(s.fa_per_10k)} | "
                f"{_fa(sl.fa_per_10k)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    from replay.labels import load_labels
    from replay.replay import discover_runs
    from replay.tuning import write_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=str(DEFAULT_SET / "runs"), help="folder (or glob) of runs")
    p.add_argument("--labels", default=None,
                   help="labels file (default: labels.parquet next to the runs folder)")
    p.add_argument("--long", default=str(DEFAULT_LONG / "runs" / "*.parquet"),
                   help="folder (or glob) of long clean runs, never tuned on ('' for none)")
    p.add_argument("--base", default="default", help="base config / preset (default %(default)s)")
    p.add_argument("--budget", type=float, default=0.5, help="false alarms per 10k clean steps")
    p.add_argument("--folds", default="arch,class", help="fold kinds: arch, class")
    p.add_argument("--window", type=int, default=200, help="detection window (recall@W)")
    p.add_argument("--thresholds", type=int, default=1000, help="thresholds per candidate")
    p.add_argument("--jobs", type=int, default=1,
                   help="processes (default 1: every process compiles the detectors)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny run: configurations 0-7 of the set, 4 long runs, arch folds "
                        "and 3 class folds, 100 thresholds")
    p.add_argument("--thresholds-only", action="store_true",
                   help="tune thresholds only (keep every binding's other parameters)")
    p.add_argument("--long-train", action="store_true",
                   help="also train on every other long clean run (FA evidence for the budget); "
                        "long-run figures from the other half")
    p.add_argument("--write-tuned", default=None,
                   help="also tune on every run and write the config here (.toml / .json)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    a = p.parse_args(argv)
    runs = discover_runs(a.runs)
    if not runs:
        p.error(f"no runs found at {a.runs!r}")
    labels_path = Path(a.labels) if a.labels else Path(a.runs).parent / "labels.parquet"
    labels = load_labels(labels_path)
    long_runs = discover_runs(a.long) if a.long else []
    kinds = [k for k in a.folds.split(",") if k]
    if a.quick:
        keep = {f"bench_{i:03d}_" for i in range(8)}
        runs = [r for r in runs if r[0][:10] in keep]
        long_runs = long_runs[:4]
        a.thresholds = min(a.thresholds, 100)
    t0 = time.perf_counter()
    folds, extra = cross_validate(runs, labels, long_runs, base=a.base, budget=a.budget,
                                  kinds=kinds, window=a.window, n_thresholds=a.thresholds,
                                  jobs=a.jobs, max_class_folds=3 if a.quick else None,
                                  thresholds_only=a.thresholds_only, long_train=a.long_train,
                                  progress=not a.quick)
    n_long = sum(1 for _ in long_runs)
    print(f"{len(runs)} runs from {a.runs}; {n_long} long clean runs from {a.long or '-'}"
          f"{' (half trained on)' if a.long_train else ''}; base {a.base}; "
          f"{'thresholds only' if a.thresholds_only else 'thresholds + grid'}; "
          f"budget {a.budget} FA/10k; window {a.window}")
    print()
    print("per fold (held-out part; tuned on the rest):")
    print(format_folds(folds))
    print()
    print("pooled held-out:")
    print(format_pooled(folds))
    print()
    print("tuned-config changes per fold (vs base):")
    for f in folds:
        print(f"  {f.kind}={f.name}: " + ("; ".join(f.changes) or "none"))
    doc: dict[str, Any] = {
        "runs": a.runs, "long": a.long, "base": a.base, "budget": a.budget,
        "window": a.window,
        "folds": [{"kind": f.kind, "name": f.name, "n_train": f.n_train, "n_test": f.n_test,
                   "tuned": f.tuned.to_dict(), "base": f.base.to_dict(),
                   "tuned_long": f.tuned_long.to_dict(), "base_long": f.base_long.to_dict(),
                   "changes": f.changes} for f in folds],
        "pooled": {k: {n: (s.to_dict() if hasattr(s, "to_dict") else s)
                       for n, s in pooled(folds, k).items()}
                   for k in kinds},
    }
    if a.write_tuned:
        from replay.tuning import build_config

        tuner = extra["tuner"]
        choices = tuner.search(list(range(len(extra["scores"]))))
        cfg = build_config(extra["base_config"], extra["candidates"], choices)
        write_config(a.write_tuned, cfg,
                     f"tuned by benchmarks/cv_detection.py on {len(runs)} runs of {a.runs}, "
                     f"budget {a.budget} FA/10k, base {a.base}\n")
        changes = _describe_changes(extra["base_config"], cfg)
        print(f"\ntuned on all {len(runs)} runs -> {a.write_tuned}:")
        for c in changes:
            print(f"  {c}")
        doc["all_runs_changes"] = changes
    secs = extra["seconds"]
    print(f"\nscoring {secs['scoring']:.0f} s, total {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=lambda x: None)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
