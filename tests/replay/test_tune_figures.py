"""``stability tune`` prints the figures of the config it writes (issue 28, round 4): every
binding of the written file counts, those left at their base setting included, so replaying the
file (``stability eval --config``) gives the printed numbers."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from replay.labels import RunLabel
from replay.tuning import Candidate, RunScores, make_tuner, tune_scores
from tests.shared_data import BENCH_LABELS, BENCH_RUNS

#: the first six configurations of the shipped benchmark (four runs each: clean and faulty)
RUNS = sorted(glob.glob(str(BENCH_RUNS / "*.parquet")))[:24]


def _figures(out: str) -> list[str]:
    """The figures of the first table row of ``out`` (the columns of ``format_table``)."""
    head = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith("name "))
    return out.splitlines()[head + 1].split()[-8:]


@pytest.mark.parametrize("search", ["warm", "greedy"])
def test_printed_figures_are_those_of_the_written_config(search: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from replay.cli import main

    out = tmp_path / "tuned.toml"
    # limits off so that the searches move thresholds on these few runs
    assert main(["tune", *RUNS, "--labels", str(BENCH_LABELS), "--budget", "2", "--folds", "0",
                 "--min-gain", "0", "--max-clean-alarmed", "1", "--hold-back", "0",
                 "--thresholds", "200", "--jobs", "1", "--search", search,
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "figures of the config written" in printed
    moved = [ln for ln in printed.splitlines() if "(base " in ln]
    if search == "greedy":
        assert moved, "greedy moved nothing: the comparison would not test the kept bindings"
    assert main(["eval", *RUNS, "--labels", str(BENCH_LABELS), "--config", str(out),
                 "--jobs", "1"]) == 0
    replayed = capsys.readouterr().out
    assert _figures(printed) == _figures(replayed)


def _two_bindings() -> tuple[list[RunScores], list[Candidate], dict[str, RunLabel], dict]:
    """Binding ``a`` separates the faults (score 3 at onset, below its base threshold 6);
    binding ``b`` never helps but alarms at its base threshold on one clean run."""
    rng = np.random.default_rng(1)
    scores, labels = [], {}
    for i in range(12):
        rid = f"r{i}"
        a, b = rng.uniform(-1, 1, 500), rng.uniform(-1, 1, 500)
        if i % 2:
            a[250] = 3.0
            labels[rid] = RunLabel(rid, "spike", 250, None, "degraded")
        else:
            labels[rid] = RunLabel(rid)
            if i == 0:
                b[100] = 7.0  # above b's base threshold: the written config alarms here
        scores.append(RunScores(rid, np.arange(500), [a, b]))
    cands = [Candidate(0, "a", "ewma_z", ("loss",), (), True),
             Candidate(1, "b", "ewma_z", ("grad_norm",), (), True)]
    base = {"detectors": [{"name": "a", "detector": "ewma_z", "inputs": ["loss"]},
                          {"name": "b", "detector": "ewma_z", "inputs": ["grad_norm"]}]}
    return scores, cands, labels, base


def test_greedy_figures_count_the_bindings_it_leaves_at_their_base_setting() -> None:
    scores, cands, labels, base = _two_bindings()
    # budget 0: the search switches a on (quiet), never b (it only adds a false alarm)
    res = tune_scores(scores, cands, labels, base, 0.0, folds=0, n_thresholds=10**6,
                      min_gain=0, max_clean_alarmed=1.0, hold_back_clean=0.0, search="greedy")
    by = {c["binding"]: c for c in res.choices}
    assert by["a"]["moved"] and not by["b"]["moved"]  # b kept at its base threshold, 6
    assert res.kept == ["b"] and res.config["detectors"][1] == base["detectors"][1]
    assert res.train.recall == 1.0
    # the written config alarms where b does: the figures say so
    assert res.train.false_alarms == 1 and res.train.clean_runs_alarmed == pytest.approx(1 / 6)
    # the search alone (b off) reports a quiet config: what tune printed before
    tn = make_tuner("greedy", scores, cands, labels, base, 0.0, n_thresholds=10**6,
                    min_gain=0, max_clean_alarmed=1.0)
    rows = list(range(len(scores)))
    assert tn.evaluate(rows, tn.search(rows))[0].false_alarms == 0


def test_warm_search_starts_from_the_base_thresholds_and_keeps_them_within_limits() -> None:
    scores, cands, labels, base = _two_bindings()
    tn = make_tuner("warm", scores, cands, labels, base, 100.0, n_thresholds=200,
                    min_gain=0, max_clean_alarmed=1.0)
    assert {b: c.threshold for b, c in tn.start.items()} == {0: 6.0, 1: 6.0}
    rows = list(range(len(scores)))
    choices = tn.search(rows)
    assert set(choices) == {0, 1}  # every binding on
    assert choices[0].threshold < 3.0 < 6.0  # a lowered to catch the faults
    assert choices[1].threshold == 6.0  # b never helps: left where it was
    # the clean-run limit: b's alarm at its base breaks it, so the warm search raises b
    # above its clean spike (or switches it off), then lowers a
    strict = make_tuner("warm", scores, cands, labels, base, 100.0, n_thresholds=200,
                        min_gain=0, max_clean_alarmed=0.0)
    choices = strict.search(rows)
    s = strict.evaluate(rows, choices)[0]
    assert choices[1].threshold >= 7.0 and choices[0].threshold < 3.0
    assert s.clean_runs_alarmed == 0.0 and s.recall == 1.0


def test_make_tuner_rejects_an_unknown_search() -> None:
    scores, cands, labels, base = _two_bindings()
    with pytest.raises(ValueError, match="'search' parameter of make_tuner"):
        make_tuner("cold", scores, cands, labels, base, 1.0)


def test_a_binding_that_freezes_on_alarms_starts_as_it_is(tmp_path: Path) -> None:
    """The ``default`` preset's ``canary_level`` freezes its reference on an alarm: the warm
    start scores it as it is, at its threshold, so the tuner counts the alarms the monitor
    raises (threshold-free scores, without the freeze, would miss all but two of them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from replay.replay import read_table, replay_run
    from replay.tuning import make_candidates, score_table, start_choices
    from stability.config.config import load_config

    rng = np.random.default_rng(0)
    step = np.arange(400)
    canary = 2.0 + 0.05 * rng.normal(size=400)
    canary[200:] *= 8.0  # the canary loss jumps and stays up
    path = tmp_path / "run.parquet"
    pq.write_table(pa.table({"step": step, "loss": 3.0 * np.exp(-step / 300),
                             "canary_loss": canary}), path)
    base = load_config("default").to_dict()
    base["monitor"]["log_only"] = True
    cands = make_candidates(base["detectors"], {})
    b = next(i for i, d in enumerate(base["detectors"]) if d["name"] == "canary_level")
    start = start_choices(base, cands)[b]
    assert not cands[start.cand].sweepable and start.threshold == 3.0
    swept = next(i for i, c in enumerate(cands) if c.binding == b and c.sweepable)
    scores = score_table(read_table(str(path)), cands, {}, "run")
    online = {a.step for a in replay_run(path, base).alarms if a.detector == "canary_level"}
    predicted = set(scores.steps[scores.scores[start.cand] > start.threshold].tolist())
    assert len(online) > 100 and predicted == online
    assert len(scores.steps[scores.scores[swept] > start.threshold]) < len(online)
