"""Evaluation functions: definitions, edge cases, nan where undefined, sweep == evaluate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from replay.evaluate import (
    alarm_episodes,
    episode_starts,
    evaluate_run,
    evaluate_runs,
    format_table,
    match,
    summarise,
)
from replay.labels import LabelError, RunLabel, labels_from_records, load_labels
from replay.scoring import candidate_thresholds, run_profile, summarise_sweep, sweep
from tests.shared_data import BENCH_LABELS, PUBLIC_LABELS, SAMPLE_LABELS, need_shared


def test_episodes_gap_boundary() -> None:
    assert alarm_episodes([0, 5, 11], gap=5) == [(0, 5), (11, 11)]
    assert episode_starts([7, 7, 7], gap=0).tolist() == [7]


def test_match_basic_and_empty() -> None:
    m = match([], [], 10)
    assert (m.tp, m.fp, m.fn) == (0, 0, 0)
    assert math.isnan(m.precision) and math.isnan(m.recall) and math.isnan(m.mean_delay)
    m = match([100, 101], [100], 0)
    assert (m.tp, m.fp, m.fn, m.delays) == (1, 1, 0, (0,))


def test_clean_run_counts_episodes() -> None:
    r = evaluate_run([10, 11, 12, 100, 500], np.arange(1000), RunLabel("c"), gap=25)
    assert r.false_alarms == 3 and r.clean_steps == 1000 and r.detected is None


def test_ringing_alarm_is_not_a_detection() -> None:
    lab = RunLabel("f", "x", onset_step=500, outcome="degraded")
    r = evaluate_run(np.arange(100, 700), np.arange(1000), lab, gap=25)
    assert r.false_alarms == 1 and not r.detected


def test_divergence_lead_and_immediate() -> None:
    lab = RunLabel("f", "x", onset_step=100, outcome="diverged", failure_step=160, nan_step=150)
    r = evaluate_run([120], np.arange(200), lab, tolerance=0)
    assert r.caught_before_divergence and r.lead == 30 and r.delay == 20
    imm = RunLabel("g", "x", onset_step=100, outcome="diverged", failure_step=100)
    r2 = evaluate_run([100], np.arange(200), imm, tolerance=0)
    assert r2.detected and r2.caught_before_divergence is None
    s = summarise([r2])
    assert s.n_div == 0 and s.n_div_immediate == 1 and math.isnan(s.recall_before_divergence)


def test_tolerance_before_onset() -> None:
    lab = RunLabel("f", "x", onset_step=100, outcome="degraded")
    assert evaluate_run([97], np.arange(200), lab, tolerance=5).delay == -3
    r = evaluate_run([90], np.arange(200), lab, tolerance=5)
    assert not r.detected and r.false_alarms == 1


def test_invisible_counted_separately() -> None:
    labs = labels_from_records([
        {"run_id": "v", "scenario": "x", "onset_step": 10, "outcome": "degraded",
         "effect_step": None},
        {"run_id": "i", "scenario": "x", "onset_step": 10, "outcome": "recovered",
         "effect_step": None},
        {"run_id": "t", "scenario": "x", "onset_step": 10, "outcome": "recovered",
         "effect_step": 12},
    ])
    assert [labs[k].visible for k in "vit"] == [True, False, True]
    steps = {k: np.arange(100) for k in "vit"}
    s, _ = evaluate_runs({"i": [10]}, steps, labs)
    assert s.recall == 0.0 and s.recall_invisible == 1.0 and s.n_visible == 2
    assert math.isnan(s.fa_per_10k) is False and s.fa_per_10k == 0.0


def test_summary_nan_when_undefined() -> None:
    s = summarise([])
    assert math.isnan(s.recall) and math.isnan(s.fa_per_10k) and math.isnan(s.precision)
    assert "-" in format_table({"x": s})


def test_labels_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LabelError, match="needs an onset_step"):
        labels_from_records([{"run_id": "a", "scenario": "overfit"}])
    with pytest.raises(LabelError, match="outcome must be one of"):
        labels_from_records([{"run_id": "a", "scenario": "x", "onset_step": 1,
                              "outcome": "bad"}])
    with pytest.raises(LabelError, match="duplicate"):
        labels_from_records([{"run_id": "a"}, {"run_id": "a"}])
    p = tmp_path / "l.csv"
    p.write_text("run_id,scenario,onset_step,outcome\na,clean,,clean\nb,overfit,12,degraded\n")
    labs = load_labels(p)
    assert labs["b"].onset_step == 12 and labs["a"].is_clean
    bad = tmp_path / "l.yaml"
    bad.write_text("x")
    with pytest.raises(LabelError, match="unknown labels format"):
        load_labels(bad)


def test_shipped_labels_load() -> None:
    labs = load_labels(str(SAMPLE_LABELS))
    assert len(labs) == 7 and {r for r, lab in labs.items() if lab.is_clean} == {"clean",
                                                                                   "clean_mlp"}
    labs = load_labels(str(BENCH_LABELS))
    assert len(labs) == 304 and sum(lab.is_clean for lab in labs.values()) == 76


def test_public_labels_load() -> None:
    labs = load_labels(str(need_shared(PUBLIC_LABELS)))
    assert len(labs) == 30 and sum(lab.is_clean for lab in labs.values()) == 8


def _random_case(rng: np.random.Generator):  # type: ignore[no-untyped-def]
    n = int(rng.integers(1, 300))
    steps = np.sort(rng.choice(np.arange(600), n, replace=False))
    s = rng.normal(size=n)
    s[rng.random(n) < 0.1] = np.nan
    s[rng.random(n) < 0.03] = np.inf
    if rng.random() < 0.3:
        lab = RunLabel("c")
    else:
        on = int(rng.integers(0, 600))
        nan = int(on + rng.integers(0, 100)) if rng.random() < 0.5 else None
        lab = RunLabel("f", "x", on, None, "diverged" if nan else "degraded", nan_step=nan)
    kw = {"window": int(rng.integers(1, 100)), "tolerance": int(rng.integers(0, 10)),
          "gap": int(rng.integers(0, 30))}
    return steps, s, lab, kw


def test_sweep_matches_evaluate_run() -> None:
    rng = np.random.default_rng(7)
    for _ in range(150):
        steps, s, lab, kw = _random_case(rng)
        p = run_profile(steps, s, lab, **kw)
        th = np.sort(np.concatenate([candidate_thresholds([p], 40), rng.normal(size=4)]))
        sw = sweep([p], th)
        for k, t in enumerate(th):
            r = evaluate_run(steps[s > t], steps, lab, **kw)
            assert r.false_alarms == sw.false_alarms[0, k]
            assert (-1 if r.lead is None else r.lead) == sw.lead[0, k]
            if r.detected is not None:
                assert r.detected == sw.detected[0, k]
                assert (-1 if r.first_alarm is None else r.first_alarm) == sw.first_alarm[0, k]


def test_sweep_summary_monotone_in_threshold() -> None:
    rng = np.random.default_rng(3)
    profs = []
    for _ in range(20):
        steps, s, lab, kw = _random_case(rng)
        profs.append(run_profile(steps, s, lab))
    th = candidate_thresholds(profs, 200)
    sm = summarise_sweep(sweep(profs, th))
    assert sm.false_alarms[-1] <= sm.false_alarms[0]
    assert sm.clean_steps > 0


def test_a_foreign_label_document_is_named_by_its_keys_not_dumped(tmp_path: Path) -> None:
    """A labels file in another format (e.g. realruns' event lists) fails with the record's
    keys and where the format is documented, not with the whole (possibly huge) record."""
    doc = [{"run": "cpm", "events": [{"quote": "x" * 5000}], **{f"k{i}": i for i in range(20)}}]
    p = tmp_path / "labels.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(LabelError) as e:
        load_labels(p)
    msg = str(e.value)
    assert "'run', 'events'" in msg and "more)" in msg and "docs/guides/tuning.md" in msg
    assert "xxxxx" not in msg and len(msg) < 500
