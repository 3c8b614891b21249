"""Several runs, one unreadable: it is a failed run (named, an ``error`` entry, status 1) and
every other run is still replayed / evaluated / tuned; one run alone keeps the error (status 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from replay.cli import main
from replay.columns import RunFormatError
from replay.fleet import RunFailure, fan_out_runs
from replay.replay import alarms_for_eval, discover_runs, replay_many, replay_run
from replay.tuning_scores import make_candidates, score_runs
from tests.shared_data import BENCH_LABELS, BENCH_RUNS

pytest.importorskip("stability.monitor.monitor")

GOOD = ["bench_000_a", "bench_000_b"]
#: a labelled run id (in BENCH_LABELS) whose file is garbage
BROKEN = "bench_001_a"
#: a comments file: JSONL without a numeric metric column (realruns/cpm_live_daily has one)
COMMENTS = "comments"


@pytest.fixture()
def runs_dir(tmp_path: Path) -> Path:
    """Two good Parquet runs, a Parquet file of garbage bytes and a comments JSONL."""
    d = tmp_path / "runs"
    d.mkdir()
    for rid in GOOD:
        shutil.copy(BENCH_RUNS / f"{rid}.parquet", d / f"{rid}.parquet")
    (d / f"{BROKEN}.parquet").write_bytes(b"PAR1 this is not a parquet file")
    rows = [{"step": i, "date": f"2023-01-0{i}", "comment": "ok"} for i in range(1, 4)]
    (d / f"{COMMENTS}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _runs(d: Path) -> list[tuple[str, str]]:
    return discover_runs(d)


def test_replay_many_reports_unreadable_runs_and_replays_the_rest(runs_dir: Path) -> None:
    runs = _runs(runs_dir)
    assert [r for r, _ in runs] == [GOOD[0], GOOD[1], BROKEN, COMMENTS]
    failed: list[RunFailure] = []
    with pytest.warns(UserWarning, match="non-numeric"):
        results = replay_many(runs, jobs=1, progress=False, failed=failed)
    assert [r.run_id for r in results] == GOOD
    alone = [replay_run(p, run_id=rid) for rid, p in runs[:2]]
    assert [r.summary()["alarms"] for r in results] == [r.summary()["alarms"] for r in alone]
    assert [(f.run_id, Path(f.path).name) for f in failed] == [
        (BROKEN, f"{BROKEN}.parquet"), (COMMENTS, f"{COMMENTS}.jsonl")]
    assert all(f.message().startswith(f.path) for f in failed)
    assert "no numeric metric columns" in failed[1].reason


def test_replay_many_without_failed_list_raises_as_before(runs_dir: Path) -> None:
    with pytest.raises(RunFormatError, match="not a readable Parquet file"):
        replay_many(_runs(runs_dir)[2:], jobs=1, progress=False)


def test_processes_report_the_same_failures(runs_dir: Path) -> None:
    runs = _runs(runs_dir)
    one: list[RunFailure] = []
    two: list[RunFailure] = []
    with pytest.warns(UserWarning):
        a = replay_many(runs, jobs=1, progress=False, failed=one)
    b = replay_many(runs, jobs=2, progress=False, failed=two)
    assert one == two
    assert [r.summary()["alarms"] for r in a] == [r.summary()["alarms"] for r in b]


def _raise_type_error(item: Any) -> int:
    raise TypeError("a bug, not an input error")


def test_programming_errors_still_propagate() -> None:
    with pytest.raises(TypeError, match="a bug"):
        fan_out_runs(_raise_type_error, [("a", "a.csv")], failed=[], backend="local", jobs=1,
                     progress=False)


def test_eval_and_scoring_jobs_report_failures(runs_dir: Path) -> None:
    runs = _runs(runs_dir)
    failed: list[RunFailure] = []
    with pytest.warns(UserWarning):
        steps, alarms = alarms_for_eval(runs, jobs=1, progress=False, failed=failed)
    assert sorted(steps) == GOOD and sorted(alarms["ours"]) == GOOD
    assert [f.run_id for f in failed] == [BROKEN, COMMENTS]
    from stability.config.config import load_config

    cands = make_candidates(load_config("default").to_dict()["detectors"])
    failed_scores: list[RunFailure] = []
    with pytest.warns(UserWarning):
        scores = score_runs(runs, cands, {}, jobs=1, progress=False, failed=failed_scores)
    assert [s.run_id for s in scores] == GOOD and failed_scores == failed


def test_cli_replay_names_the_failed_run_and_exits_1(runs_dir: Path, capsys: Any) -> None:
    assert main(["replay", str(runs_dir), "--jobs", "1"]) == 1
    cap = capsys.readouterr()
    fails = [x for x in cap.err.splitlines() if ": failed: " in x]
    assert len(fails) == 2 and f"run {BROKEN}: {runs_dir / BROKEN}.parquet: " in fails[0]
    assert f"run {COMMENTS}: {runs_dir / COMMENTS}.jsonl: no numeric metric columns" in fails[1]
    for rid in GOOD:
        assert f"run {rid}  (240 steps" in cap.out
    assert "4 runs, 2 could not be read" in cap.out


def test_cli_replay_json_has_error_entries_in_run_order(runs_dir: Path, capsys: Any,
                                                         tmp_path: Path) -> None:
    ev = tmp_path / "events"
    assert main(["replay", str(runs_dir), "--jobs", "2", "--json", "--events", str(ev)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [x["run_id"] for x in data] == [*GOOD, BROKEN, COMMENTS]
    assert ["error" in x for x in data] == [False, False, True, True]
    assert data[3]["error"].endswith("no numeric metric columns")
    assert sorted(p.name for p in ev.iterdir()) == [f"{rid}.jsonl" for rid in GOOD]


def test_cli_one_unreadable_run_keeps_the_error(runs_dir: Path, capsys: Any) -> None:
    assert main(["replay", str(runs_dir / f"{COMMENTS}.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "no numeric metric columns" in err and "failed:" not in err


def test_cli_bad_config_is_one_error_not_a_failure_per_run(runs_dir: Path, capsys: Any) -> None:
    assert main(["replay", str(runs_dir), "--jobs", "1", "--config", "no_such_preset"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "failed:" not in err


def test_cli_eval_names_the_labelled_run_it_leaves_out(runs_dir: Path, capsys: Any) -> None:
    args = ["eval", str(runs_dir), "--labels", str(BENCH_LABELS), "--jobs", "1"]
    assert main(args) == 1
    cap = capsys.readouterr()
    assert cap.out.startswith("2 runs (")
    assert f"not in these figures (could not be read): {BROKEN} (labelled " in cap.out
    assert f"failed: run {BROKEN}" in cap.err
    assert main([*args, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["run_id"] for f in data["failed"]] == [BROKEN, COMMENTS] and "ours" in data


def test_cli_tune_names_the_left_out_runs_in_the_config(runs_dir: Path, tmp_path: Path,
                                                        capsys: Any) -> None:
    out = tmp_path / "tuned.toml"
    rc = main(["tune", str(runs_dir), "--labels", str(BENCH_LABELS), "--budget", "2", "-o",
               str(out), "--folds", "0", "--jobs", "1", "--thresholds", "50"])
    assert rc == 1 and out.exists()
    text = out.read_text()
    assert "on 2 runs" in text and f"could not be read): {BROKEN} (labelled " in text
    assert f"failed: run {COMMENTS}" in capsys.readouterr().err
