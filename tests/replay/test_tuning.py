"""Tuning: respects the budget on held-out folds, writes a config the monitor loads."""

from __future__ import annotations

import glob

import numpy as np
import pytest

from replay.labels import RunLabel, load_labels
from replay.tuning import (
    Candidate,
    RunScores,
    make_candidates,
    make_folds,
    score_runs,
    to_toml,
    tune_scores,
    write_config,
)
from tests.shared_data import BENCH_LABELS, BENCH_RUNS

#: the shipped benchmark runs, four per configuration (``bench_000_a`` ... ``bench_002_d``: every
#: model of the benchmark, clean and faulty runs)
BENCH = sorted(glob.glob(str(BENCH_RUNS / "*.parquet")))
LABELS = str(BENCH_LABELS)

BASE = {"monitor": {"aliases": {}, "log_only": False, "strict": False}, "detectors": [
    {"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"], "kind": "nonfinite"},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"], "kind": "loss_spike",
     "params": {"alpha": 0.02}},
    {"name": "grad", "detector": "ewma_z", "inputs": ["grad_norm"], "kind": "grad_explosion"},
], "policy": {}}


def _synthetic(n_runs: int = 40, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    scores, labels = [], {}
    for i in range(n_runs):
        rid = f"r{i}"
        s = rng.normal(size=1000)
        if i % 2:
            on = int(rng.integers(300, 700))
            s[on:on + 5] += rng.uniform(1.0, 6.0)
            labels[rid] = RunLabel(rid, "spike", on, None, "degraded")
        else:
            labels[rid] = RunLabel(rid)
        scores.append(RunScores(rid, np.arange(1000), [s, np.full(1000, -np.inf)]))
    cands = [Candidate(1, "a", "ewma_z", ("loss",), (), True),
             Candidate(0, "nf", "nonfinite", ("*",), (), False)]
    base = {"detectors": [{"name": "nf", "detector": "nonfinite", "inputs": ["*"]},
                          {"name": "a", "detector": "ewma_z", "inputs": ["loss"]}]}
    return scores, cands, labels, base


@pytest.mark.parametrize("budget", [0.5, 3.0])
def test_budget_respected_on_train_and_reported_heldout(budget: float) -> None:
    scores, cands, labels, base = _synthetic()
    res = tune_scores(scores, cands, labels, base, budget, folds=4, n_thresholds=300)
    assert res.train.fa_per_10k <= budget
    assert res.heldout is not None and res.heldout.n_runs == 40
    # held-out on data from the same distribution stays near the budget
    assert res.heldout.fa_per_10k <= 3 * budget + 1.0
    assert res.config["detectors"][1]["params"]["threshold"] > 0


def test_folds_stratified() -> None:
    labs = {f"c{i}": RunLabel(f"c{i}") for i in range(6)}
    labs.update({f"f{i}": RunLabel(f"f{i}", "x", 5, None, "degraded") for i in range(4)})
    folds = make_folds(list(labs), labs, 2)
    assert sorted(i for f in folds for i in f) == list(range(10))
    assert all(sum(1 for i in f if i >= 6) == 2 for f in folds)


def test_toml_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tomllib = pytest.importorskip("tomllib")
    cfg = {"monitor": {"aliases": {"lm loss": "loss"}, "log_only": False},
           "detectors": [{"name": "x", "detector": "ewma_z", "inputs": ["loss"],
                          "params": {"threshold": float("inf"), "log_space": [True, False]}}],
           "policy": {"a": {"b": 1, "c": "d"}}}
    assert tomllib.loads(to_toml(cfg)) == cfg
    write_config(tmp_path / "c.toml", cfg, header="hello")
    assert tomllib.loads((tmp_path / "c.toml").read_text()) == cfg


def test_tune_writes_config_monitor_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stability.config.config import MonitorConfig, load_config

    base = MonitorConfig.from_dict(BASE).to_dict()
    cands = make_candidates(base["detectors"])
    runs = [(p.split("/")[-1][:-8], p) for p in BENCH[:12]]
    scores = score_runs(runs, cands, {}, jobs=1, progress=False)
    labels = load_labels(LABELS)
    res = tune_scores(scores, cands, labels, base, 2.0, folds=3, n_thresholds=200)
    assert res.train.fa_per_10k <= 2.0
    out = tmp_path / "tuned.toml"
    write_config(out, res.config)
    cfg = load_config(str(out))
    assert cfg.detectors[0].detector == "nonfinite"
    try:
        from stability.monitor.monitor import Monitor
    except ImportError:  # pragma: no cover
        return
    Monitor(str(out))


def test_ray_backend_matches_local() -> None:
    pytest.importorskip("ray")
    from stability.config.config import MonitorConfig

    base = MonitorConfig.from_dict(BASE).to_dict()
    cands = make_candidates(base["detectors"], grids={})
    runs = [(p.split("/")[-1][:-8], p) for p in BENCH[:2]]
    assert len(runs) == 2
    local = score_runs(runs, cands, {}, jobs=1, progress=False)
    remote = score_runs(runs, cands, {}, backend="ray", progress=False)
    for a, b in zip(local, remote, strict=True):
        assert a.run_id == b.run_id
        for x, y in zip(a.scores, b.scores, strict=True):
            np.testing.assert_array_equal(x, y)


def test_tuned_config_replays_to_the_alarms_the_tuner_predicted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One binder: the alarms the tuner counted are exactly those the monitor raises online."""
    from replay.replay import replay_run
    from replay.tuning import score_table
    from stability.config.config import MonitorConfig

    base = MonitorConfig.from_dict(BASE).to_dict()
    cands = make_candidates(base["detectors"])
    runs = [(p.split("/")[-1][:-8], p) for p in BENCH[:8]]
    scores = score_runs(runs, cands, {}, jobs=1, progress=False)
    res = tune_scores(scores, cands, load_labels(LABELS), base, 3.0, folds=0, n_thresholds=100)
    tuned = res.config["detectors"]
    thresholds = {d["name"]: d["params"]["threshold"] for d in tuned if "threshold" in
                  d.get("params", {})}
    assert thresholds, "nothing was tuned"
    out = tmp_path / "tuned.toml"
    write_config(out, res.config)
    tuned_cands = [c for c in make_candidates(tuned, grids={}) if c.name in thresholds]
    from replay.replay import read_table

    checked = 0
    for rid, path in runs:
        predicted = score_table(read_table(path), tuned_cands, {}, rid)
        online = replay_run(path, str(out))
        for c, s in zip(tuned_cands, predicted.scores, strict=True):
            want = set(predicted.steps[s > thresholds[c.name]].tolist())
            got = {a.step for a in online.alarms if a.detector == c.name}
            assert got == want, (rid, c.name, sorted(got ^ want)[:5])
            checked += len(want)
    assert checked > 0, "no alarm at all: the comparison would be vacuous"
