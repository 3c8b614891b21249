"""CLI end to end on the shipped runs; replay batch path == observe() loop for the summary."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from replay.cli import build_parser, main
from replay.replay import discover_runs, goodput, read_table, replay_run, replay_table
from tests.shared_data import BENCH_LABELS, BENCH_RUNS, SAMPLE_LABELS, SAMPLE_RUNS

RUNS = str(SAMPLE_RUNS)
LABELS = str(SAMPLE_LABELS)
BITFLIP = f"{RUNS}/bitflip"  # a directory of parts: NaN weights from step 300

monitor = pytest.importorskip("stability.monitor.monitor")


def test_replay_batch_equals_observe_loop() -> None:
    table = read_table(BITFLIP)
    batch = replay_table(table, None, "bitflip")
    mon = monitor.Monitor()
    cols = {c: table.column(c).to_pylist() for c in table.column_names}
    alarms, ivs = [], []
    for i, step in enumerate(cols["step"]):
        metrics = {k: v[i] for k, v in cols.items() if k != "step" and v[i] is not None}
        d = mon.observe(int(step), metrics)
        alarms.extend(d.alarms)
        ivs.extend(d.interventions)
    assert [a.to_dict() for a in alarms] == [a.to_dict() for a in batch.alarms]
    assert [i.to_dict() for i in ivs] == [i.to_dict() for i in batch.interventions]
    s = batch.summary()
    assert s["alarms_by_kind"].get("nonfinite", 0) > 0
    assert s["goodput"] == goodput(batch.steps, ivs)


def test_cli_replay_one_run_with_events(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    ev = tmp_path / "events.jsonl"
    assert main(["replay", BITFLIP, "--events", str(ev)]) == 0
    out = capsys.readouterr().out
    assert "run bitflip" in out and "goodput" in out and "first at step" in out
    lines = [json.loads(x) for x in ev.read_text().splitlines()]
    assert lines and all(x["run_id"] == "bitflip" for x in lines)
    pq_ev = tmp_path / "events.parquet"
    res = replay_run(BITFLIP, events=pq_ev)
    import pyarrow.parquet as pq

    t = pq.read_table(pq_ev)
    assert t.num_rows == len(res.alarms) + len(res.interventions)


def test_cli_replay_glob_and_dir_of_parts(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "runs" / "myrun"
    d.mkdir(parents=True)
    shutil.copy(BENCH_RUNS / "bench_000_a.parquet", d / "part-000000.parquet")
    shutil.copy(BENCH_RUNS / "bench_000_b.parquet", tmp_path / "runs" / "other.parquet")
    assert [r[0] for r in discover_runs(tmp_path / "runs")] == ["myrun", "other"]
    assert [r[0] for r in discover_runs(str(tmp_path / "runs" / "*"))] == ["myrun", "other"]
    assert main(["replay", str(tmp_path / "runs"), "--jobs", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [x["run_id"] for x in data] == ["myrun", "other"]


def test_cli_eval_with_baselines(capsys) -> None:  # type: ignore[no-untyped-def]
    runs = [f"{RUNS}/{name}" for name in ("clean", "lr_blowup", "bitflip")]
    assert main(["eval", *runs, "--labels", LABELS, "--baselines", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("ours", "sigma6_128", "ratio2x_w100_p5", "nan_only", "page_hinkley", "adwin"):
        assert name in out


def test_cli_tune_writes_loadable_config(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "tuned.toml"
    runs = sorted(str(p) for p in BENCH_RUNS.glob("bench_00[01]_*.parquet"))
    assert len(runs) == 8
    rc = main(["tune", *runs, "--labels", str(BENCH_LABELS), "--budget", "2", "-o", str(out),
               "--folds", "2", "--jobs", "1", "--thresholds", "100"])
    assert rc == 0 and out.exists()
    assert "held-out" in capsys.readouterr().out
    monitor.Monitor(str(out))


def test_cli_errors_and_help(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["replay", "/nonexistent/x.parquet"]) == 2
    assert main([]) == 2
    assert {"replay", "eval", "tune", "report"} <= set(
        build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_goodput_rollback_and_stop() -> None:
    from stability.types import Rollback, Stop

    g = goodput(np.arange(100), [Rollback(50, to_step=40), Stop(79)])
    assert g["rollback_steps"] == 10 and g["steps_after_stop"] == 20 and g["executed_steps"] == 80
