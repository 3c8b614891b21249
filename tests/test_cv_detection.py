"""Cross-validated detection (``benchmarks/cv_detection.py``) and the long clean runs option.

Uses 8 configurations of the committed issue-14 benchmark (32 runs of 240 steps) and 4 of the
long clean runs; skipped when the sets are not there.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "data" / "bench14"
LONG = ROOT / "benchmarks" / "data" / "bench14_clean_long"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


cv = _load("cv_detection")
mb = _load("make_benchmark")


def test_plan_clean_long_covers_the_grid_and_is_deterministic():
    p = mb.plan_clean_long(24, 1200, 14)
    assert p == mb.plan_clean_long(24, 1200, 14)
    cfgs = [c for c, _, _ in p]
    assert all(not faults for _, faults, _ in p)
    assert {(c.arch, c.precision) for c in cfgs[:12]} == {
        (a, q) for a in mb.ARCHS for q in mb.PRECISIONS}
    assert {(c.arch, c.optimizer) for c in cfgs[:16]} == {
        (a, o) for a in mb.ARCHS for o in mb.OPTIMIZERS}
    assert {c.schedule for c in cfgs} == set(mb.SCHEDULES)
    assert all(c.steps == 1200 for c in cfgs)
    bench_seeds = {c.seed for c, _, _ in mb.plan(76, 3, 240, 14)}
    assert not bench_seeds & {c.seed for c in cfgs}
    assert len({ids[0] for _, _, ids in p}) == 24


@pytest.fixture(scope="module")
def labels():
    if not (BENCH / "labels.parquet").exists() or not (LONG / "labels.parquet").exists():
        pytest.skip("benchmarks/data/bench14(_clean_long) not present")
    from replay.labels import load_labels

    return {**load_labels(BENCH / "labels.parquet"), **load_labels(LONG / "labels.parquet")}


def test_folds_hold_out_each_architecture_and_class_with_long_runs(labels):
    ids = sorted(k for k in labels if k.startswith("bench_"))
    long_ids = sorted(k for k in labels if k.startswith("long_"))
    n = len(ids)
    all_ids = [*ids, *long_ids]
    folds = cv.fold_rows(ids, labels, ("arch", "class"), long_ids=long_ids)
    arch = [f for f in folds if f.kind == "arch"]
    cls = [f for f in folds if f.kind == "class"]
    assert sorted(f.name for f in arch) == ["conv", "gpt_post", "gpt_pre", "mlp"]
    # arch folds partition everything, long runs included, by architecture
    assert sorted(i for f in arch for i in f.test) == list(range(n + len(long_ids)))
    for f in folds:
        assert not set(f.train) & set(f.test)
        assert len(f.train) + len(f.test) == len(all_ids)
        models = {labels[all_ids[i]].extra["model"] for i in f.test}
        if f.kind == "arch":
            assert models == {f.name}
            assert sum(i >= n for i in f.test) == 6
        else:
            assert {labels[all_ids[i]].scenario for i in f.test if i < n} == {f.name}
            assert not any(labels[all_ids[i]].scenario == f.name for i in f.train)
            # half of every architecture's long runs held out, the other half trained on
            for m in ("mlp", "gpt_pre", "gpt_post", "conv"):
                tr = [i for i in f.train if i >= n and labels[all_ids[i]].extra["model"] == m]
                te = [i for i in f.test if i >= n and labels[all_ids[i]].extra["model"] == m]
                assert len(tr) == len(te) == 3
    assert len(cls) == len({lab.scenario for lab in labels.values() if not lab.is_clean})
    # every class fold holds out the same long half
    assert len({tuple(i for i in f.test if i >= n) for f in cls}) == 1


def test_consensus_is_the_median_threshold_and_drops_mostly_dropped_bindings():
    from stability.config.config import load_config

    base = load_config("default").to_dict()

    def fold(ths):
        return cv.FoldResult("arch", "x", 0, 0, None, None, None, None, thresholds=ths)

    folds = [fold({"loss_spike": 5.0, "lr_jump": math.inf}),
             fold({"loss_spike": 7.0, "lr_jump": math.inf}),
             fold({"loss_spike": 9.0, "lr_jump": 3.0})]
    cfg, per = cv.consensus_config(base, folds)
    by = {d["name"]: d for d in cfg["detectors"]}
    assert by["loss_spike"]["params"]["threshold"] == 7.0
    assert by["loss_spike"]["params"]["alpha"] == 0.02  # other parameters kept
    assert "lr_jump" not in by
    assert per["loss_spike"] == [5.0, 7.0, 9.0]
    assert by["grad_explosion"] == next(d for d in base["detectors"]
                                        if d["name"] == "grad_explosion")


def test_quick_run_prints_folds_and_consensus(labels, tmp_path, capsys):
    from replay.evaluate import evaluate_runs
    from replay.replay import alarms_for_eval, discover_runs

    out = tmp_path / "cv.json"
    cons = tmp_path / "consensus.toml"
    rc = cv.main(["--quick", "--json", str(out), "--write-consensus", str(cons)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pooled held-out" in text and "arch=conv" in text and "consensus" in text
    doc = json.loads(out.read_text())
    assert [f["name"] for f in doc["folds"]][:4] == ["conv", "gpt_post", "gpt_pre", "mlp"]
    assert sum(f["n_test"] for f in doc["folds"] if f["kind"] == "arch") == 32 + 4
    # the base figures are those of a plain replay of the preset on the held-out runs
    runs = [r for r in discover_runs(BENCH / "runs") if r[0][:10] in
            {f"bench_{i:03d}_" for i in range(8)}]
    conv = [r for r in runs if labels[r[0]].extra["model"] == "conv"]
    conv += [r for r in discover_runs(LONG / "runs")[:4] if labels[r[0]].extra["model"] == "conv"]
    steps, alarms = alarms_for_eval(conv, "default", jobs=1, progress=False)
    s = evaluate_runs(alarms["ours"], steps, labels)[0]
    assert doc["folds"][0]["base"]["recall_all"] == pytest.approx(s.recall_all)
    assert doc["folds"][0]["base"]["clean_steps"] == s.clean_steps
    # the consensus file is a loadable config whose thresholds are the reported medians
    from stability.config.config import load_config

    c = load_config(str(cons)).to_dict()
    got = {d["name"]: d["params"]["threshold"] for d in c["detectors"]
           if d["name"] in doc["consensus_thresholds"]}
    assert got == doc["consensus_thresholds"]


def test_warm_tuner_keeps_budget_under_replay_and_never_loses_training_recall(labels):
    from replay.evaluate import evaluate_runs
    from replay.replay import alarms_for_eval, discover_runs
    from replay.tuning import (
        EvalSettings,
        base_thresholds,
        build_config,
        make_candidates,
        make_tuner,
        score_runs,
    )
    from stability.config.config import load_config

    runs = [r for r in discover_runs(BENCH / "runs") if r[0][:10] in
            {f"bench_{i:03d}_" for i in range(8)}] + discover_runs(LONG / "runs")[:2]
    base = load_config("default").to_dict()
    cands = make_candidates(base["detectors"], {})
    scores = score_runs(runs, cands, {}, jobs=1, progress=False)
    start = base_thresholds(base, cands)
    budget = 2.0
    for recall_only in (False, True):
        tn = make_tuner("warm", scores, cands, labels, base, budget, EvalSettings(), 200,
                        recall_only=recall_only)
        assert {b: c.threshold for b, c in tn.start.items()} == start
        rows = list(range(len(scores)))
        s0 = tn.evaluate(rows, tn.start)[0]
        choices = tn.search(rows)
        assert set(choices) == set(start)  # every binding kept
        s1 = tn.evaluate(rows, choices)[0]
        assert s1.fa_per_10k <= budget
        if s0.fa_per_10k <= budget:
            assert s1.recall >= s0.recall
        # the replayed config gives the tuner's figures
        steps, alarms = alarms_for_eval(runs, build_config(base, cands, choices), jobs=1,
                                        progress=False)
        s = evaluate_runs(alarms["ours"], steps, labels)[0]
        assert s.fa_per_10k <= budget
        assert s.recall == pytest.approx(s1.recall)


def test_validation_runs_are_held_back_and_veto_new_false_alarms(labels):
    from replay.replay import discover_runs
    from replay.tuning import EvalSettings, make_candidates, make_tuner, score_runs
    from stability.config.config import load_config

    bench = [r for r in discover_runs(BENCH / "runs") if r[0][:10] in
             {f"bench_{i:03d}_" for i in range(8)}]
    long_runs = discover_runs(LONG / "runs")[:8]  # two per architecture
    runs = bench + long_runs
    ids = [r for r, _ in runs]
    tune, val = cv._hold_back_long(list(range(len(runs))), ids, labels, len(bench))
    assert sorted(tune + val) == list(range(len(runs)))
    assert all(i >= len(bench) for i in val)
    assert sorted(labels[ids[i]].extra["model"] for i in val) == ["conv", "gpt_post", "gpt_pre",
                                                                  "mlp"]
    base = load_config("default").to_dict()
    cands = make_candidates(base["detectors"], {})
    scores = score_runs(runs, cands, {}, jobs=1, progress=False)
    tn = make_tuner("warm", scores, cands, labels, base, 5.0, EvalSettings(), 200)
    free = tn.search(tune)
    vetoed = tn.search(tune, val=val)
    fa = [tn.evaluate(val, c)[0].false_alarms for c in (tn.start, free, vetoed)]
    assert fa[2] <= fa[0]
    assert tn.evaluate(tune, vetoed)[0].fa_per_10k <= 5.0
