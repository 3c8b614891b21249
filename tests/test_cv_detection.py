"""Cross-validated detection (``benchmarks/cv_detection.py``) and the long clean runs option.

Uses 8 configurations of the committed issue-14 benchmark (32 runs of 240 steps); skipped when
the set is not there.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "data" / "bench14"


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
    if not (BENCH / "labels.parquet").exists():
        pytest.skip("benchmarks/data/bench14 not present")
    from replay.labels import load_labels

    return load_labels(BENCH / "labels.parquet")


def test_folds_partition_by_architecture_and_hold_out_each_class(labels):
    ids = sorted(labels)
    folds = cv._fold_rows(ids, labels, ("arch", "class"))
    arch = [f for f in folds if f[0] == "arch"]
    cls = [f for f in folds if f[0] == "class"]
    assert sorted(f[1] for f in arch) == ["conv", "gpt_post", "gpt_pre", "mlp"]
    assert sorted(i for f in arch for i in f[3]) == list(range(len(ids)))
    for kind, name, train, test in folds:
        assert not set(train) & set(test)
        assert len(train) + len(test) == len(ids)
        if kind == "class":
            assert {labels[ids[i]].scenario for i in test} == {name}
            assert not any(labels[ids[i]].scenario == name for i in train)
    assert len(cls) == len({lab.scenario for lab in labels.values() if not lab.is_clean})


def test_quick_run_prints_folds_and_tuned_config_meets_budget_on_training(labels, tmp_path,
                                                                          capsys):
    from replay.evaluate import evaluate_runs
    from replay.replay import alarms_for_eval, discover_runs

    out = tmp_path / "cv.json"
    tuned = tmp_path / "tuned.toml"
    rc = cv.main(["--quick", "--folds", "arch", "--long", "", "--json", str(out),
                  "--write-tuned", str(tuned)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pooled held-out" in text and "arch=conv" in text
    doc = json.loads(out.read_text())
    assert [f["name"] for f in doc["folds"]] == ["conv", "gpt_post", "gpt_pre", "mlp"]
    assert sum(f["n_test"] for f in doc["folds"]) == 32
    # the base figures are those of a plain replay of the preset on the held-out runs
    runs = [r for r in discover_runs(BENCH / "runs") if r[0][:10] in
            {f"bench_{i:03d}_" for i in range(8)}]
    conv = [r for r in runs if labels[r[0]].extra["model"] == "conv"]
    steps, alarms = alarms_for_eval(conv, "default", jobs=1, progress=False)
    s = evaluate_runs(alarms["ours"], steps, labels)[0]
    assert doc["folds"][0]["base"]["recall_all"] == pytest.approx(s.recall_all)
    # the config tuned on all 32 runs keeps the false-alarm budget when the monitor replays it
    steps, alarms = alarms_for_eval(runs, str(tuned), jobs=1, progress=False)
    s = evaluate_runs(alarms["ours"], steps, labels)[0]
    assert s.fa_per_10k <= doc["budget"] + 1e-9
