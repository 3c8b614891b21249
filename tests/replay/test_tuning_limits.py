"""The tuner's limits besides the false-alarm budget (issue 28): clean runs alarmed, the fewest
faults a move must gain, and clean runs held back to check every move."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from replay.labels import RunLabel
from replay.tuning import (
    DEFAULT_MAX_CLEAN_ALARMED,
    Candidate,
    RunScores,
    Tuner,
    hold_back,
    tune_scores,
)

DATA = Path(__file__).resolve().parents[2] / "data"

CLEAN_STEPS, FAULTY_STEPS, ONSET = 10_000, 1_000, 500


def _runs(fault_scores: dict[str, tuple[float, float]], clean_spikes: dict[str, float],
          n_clean: int = 10) -> tuple[list[RunScores], list[Candidate], dict[str, RunLabel]]:
    """Two tunable bindings, ``a`` and ``b``, on quiet scores (|score| <= 1, one decimal: few
    distinct values, so every spike is a threshold the tuner sweeps).

    ``fault_scores[run] = (a, b)``: the scores of the two bindings at the onset of a faulty run;
    ``clean_spikes[run] = a``: one spike of binding ``a`` half way through a clean run.
    """
    rng = np.random.default_rng(0)

    def quiet(n: int) -> np.ndarray:
        return np.round(rng.uniform(-1, 1, n), 1)

    scores, labels = [], {}
    for i in range(n_clean):
        rid = f"c{i}"
        a, b = quiet(CLEAN_STEPS), quiet(CLEAN_STEPS)
        if rid in clean_spikes:
            a[CLEAN_STEPS // 2] = clean_spikes[rid]
        scores.append(RunScores(rid, np.arange(CLEAN_STEPS), [a, b]))
        labels[rid] = RunLabel(rid)
    for rid, (sa, sb) in fault_scores.items():
        a, b = quiet(FAULTY_STEPS), quiet(FAULTY_STEPS)
        a[ONSET], b[ONSET] = sa, sb
        scores.append(RunScores(rid, np.arange(FAULTY_STEPS), [a, b]))
        labels[rid] = RunLabel(rid, "spike", ONSET, None, "degraded")
    cands = [Candidate(0, "a", "ewma_z", ("loss",), (), True),
             Candidate(1, "b", "ewma_z", ("grad_norm",), (), True)]
    return scores, cands, labels


def _threshold(choices: dict, binding: int) -> float:
    return choices[binding].threshold if binding in choices else float("inf")


def test_clean_run_limit_refuses_a_move_the_budget_accepts() -> None:
    # two faults score 4 on binding a, four score 8; one clean run of ten spikes to 5 once:
    # catching the two weak faults costs one false-alarm episode in ~103k clean steps
    # (0.1 per 10k, within a budget of 0.5) -- on one clean run in ten
    faults = {f"f{i}": (4.0 if i < 2 else 8.0, 0.0) for i in range(6)}
    scores, cands, labels = _runs(faults, {"c0": 5.0})
    rows = list(range(len(scores)))
    budget_only = Tuner(scores, cands, labels, 0.5, n_thresholds=500, max_clean_alarmed=1.0,
                        min_gain=0)
    ch = budget_only.search(rows)
    s = budget_only.evaluate(rows, ch)[0]
    assert _threshold(ch, 0) < 4.0
    assert s.recall == 1.0 and s.false_alarms == 1 and s.fa_per_10k <= 0.5
    assert s.clean_runs_alarmed == pytest.approx(0.1)

    both = Tuner(scores, cands, labels, 0.5, n_thresholds=500, min_gain=0)
    assert both.max_clean_alarmed == DEFAULT_MAX_CLEAN_ALARMED == 0.01
    ch = both.search(rows)
    s = both.evaluate(rows, ch)[0]
    assert _threshold(ch, 0) >= 5.0
    assert s.clean_runs_alarmed == 0.0 and s.false_alarms == 0
    assert s.recall == pytest.approx(4 / 6)

    # the limit is inclusive: one clean run in ten is allowed at 0.1
    tenth = Tuner(scores, cands, labels, 0.5, n_thresholds=500, max_clean_alarmed=0.1,
                  min_gain=0)
    assert _threshold(tenth.search(rows), 0) < 4.0


def test_min_gain_refuses_a_move_fitted_to_one_fault() -> None:
    # binding a catches five faults; binding b only the sixth (which a misses)
    faults = {f"f{i}": ((0.0, 6.0) if i == 0 else (8.0, 0.0)) for i in range(6)}
    scores, cands, labels = _runs(faults, {})
    rows = list(range(len(scores)))
    recalls = {}
    for min_gain in (0, 1, 2):
        tn = Tuner(scores, cands, labels, 0.5, n_thresholds=500, min_gain=min_gain)
        ch = tn.search(rows)
        assert 0 in ch  # switching a on gains five faults
        recalls[min_gain] = tn.evaluate(rows, ch)[0].recall
        assert (1 in ch) == (min_gain < 2)
    assert recalls == {0: 1.0, 1: 1.0, 2: pytest.approx(5 / 6)}
    nothing = Tuner(scores, cands, labels, 0.5, n_thresholds=500, min_gain=6)
    assert nothing.search(rows) == {}


def test_held_back_clean_runs_veto_a_move_that_alarms_on_them() -> None:
    # thresholds are placed on the scores of the runs tuned on (4, 6, 8), never on a held-back one
    faults = {f"f{i}": ((4.0, 6.0, 8.0)[i // 2], 0.0) for i in range(6)}
    scores, cands, labels = _runs(faults, {"c0": 5.0})
    rows = list(range(len(scores)))
    tn = Tuner(scores, cands, labels, 0.5, n_thresholds=500, min_gain=0)
    tune_rows = [r for r in rows if r != 0]  # c0, the spiky clean run, held back
    free = tn.search(tune_rows)
    checked = tn.search(tune_rows, val=[0])
    assert _threshold(free, 0) < 4.0  # c0 unseen: nothing stops the low threshold
    assert _threshold(checked, 0) >= 5.0
    assert tn.evaluate([0], checked)[0].false_alarms == 0
    assert tn.evaluate(tune_rows, checked)[0].recall == pytest.approx(2 / 6)


def test_hold_back_draws_clean_runs_only_and_leaves_one_to_tune_on() -> None:
    ids = [f"c{i}" for i in range(6)] + ["f0", "f1"]
    labels = {f: RunLabel(f, "x", 5, None, "degraded") for f in ("f0", "f1")}
    rows = list(range(len(ids)))
    tune, val = hold_back(ids, labels, rows, 0.5)
    assert len(val) == 3 and sorted(tune + val) == rows
    assert {6, 7} <= set(tune) and not {6, 7} & set(val)
    assert hold_back(ids, labels, rows, 0.5) == (tune, val)  # deterministic
    assert hold_back(ids, labels, rows, 0.0) == (rows, [])
    assert len(hold_back(ids, labels, [0, 6], 0.9)[1]) == 0  # the only clean run stays
    assert len(hold_back(ids, labels, rows, 1.0)[1]) == 5  # all but one
    with pytest.raises(ValueError, match="'fraction' parameter of hold_back"):
        hold_back(ids, labels, rows, 1.5)


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_clean_alarmed": 1.5}, "'max_clean_alarmed' parameter of Tuner"),
    ({"min_gain": -1}, "'min_gain' parameter of Tuner"),
    ({"min_gain": 1.5}, "'min_gain' parameter of Tuner"),
])
def test_tuner_rejects_bad_limits(kw: dict, match: str) -> None:
    scores, cands, labels = _runs({}, {}, n_clean=1)
    with pytest.raises(ValueError, match=match):
        Tuner(scores, cands, labels, 0.5, **kw)


def test_tune_scores_keeps_both_limits_on_all_runs() -> None:
    # held back or tuned on, every clean run ends up checked: the spiky one stays quiet
    faults = {f"f{i}": (4.0 if i < 2 else 8.0, 0.0) for i in range(6)}
    scores, cands, labels = _runs(faults, {"c0": 5.0, "c7": 4.5})
    base = {"detectors": [{"name": "a", "detector": "ewma_z", "inputs": ["loss"]},
                          {"name": "b", "detector": "ewma_z", "inputs": ["grad_norm"]}]}
    for hb in (0.0, 0.5):
        res = tune_scores(scores, cands, labels, base, 0.5, folds=0, n_thresholds=500,
                          min_gain=0, hold_back_clean=hb)
        assert res.train.clean_runs_alarmed == 0.0 and res.train.fa_per_10k <= 0.5
        assert res.config["detectors"][0]["params"]["threshold"] >= 5.0


def test_cli_tune_limit_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replay.cli import build_parser, main

    a = build_parser().parse_args(["tune", "x", "--budget", "1", "-o", "t.toml"])
    assert (a.max_clean_alarmed, a.min_gain, a.hold_back) == (0.01, 2, 0.5)
    out = tmp_path / "tuned.toml"
    rc = main(["tune", str(DATA / "runs"), "--labels", str(DATA / "labels.parquet"),
               "--budget", "5", "--folds", "0", "--jobs", "1", "--thresholds", "100",
               "--max-clean-alarmed", "1", "--min-gain", "0", "--hold-back", "0", "-o", str(out)])
    assert rc == 0
    head = out.read_text().splitlines()[0]
    assert "at most 1 of clean runs alarmed" in head and "gaining >= 0 faults" in head
    assert "0 of clean runs held back" in head
    capsys.readouterr()
    for bad in (["--max-clean-alarmed", "2"], ["--hold-back", "-0.1"], ["--min-gain", "-1"],
                ["--min-gain", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["tune", "x", "--budget", "1", "-o", "t.toml", *bad])
        assert e.value.code == 2
        assert bad[0] in capsys.readouterr().err
