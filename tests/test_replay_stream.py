"""Streamed replay (issue 17): a run fed batch after batch through one monitor's
:meth:`~stability.monitor.monitor.Monitor.replay_stream` (the replay's chunk blocks and the
non-finite
guard's constant columns kept across batches), and :func:`replay.replay.replay_run` reading a
Parquet run in record batches -- equal, bit for bit, to the whole-table replay and to a loop of
``observe()``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay import stream as rs
from replay.reader import read_run
from replay.replay import plan_replay, replay_run, replay_table
from stability import Monitor
from stability.config.config import load_config
from stability.monitor import replay as mr
from stability.monitor.decisions import Decisions
from stability.run.checkpoints import CheckpointLedger

_spec = importlib.util.spec_from_file_location(
    "_replay_fast", Path(__file__).with_name("test_replay_fast.py"))
assert _spec is not None and _spec.loader is not None
_fast = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fast)
CFG, run_table, observe_all = _fast.CFG, _fast.run_table, _fast.observe_all

ROLLBACK = {**CFG, "policy": {"ladder": [["alert", "rollback"]]}}


def monitor(cfg: Any) -> Monitor:
    """A monitor; with the rollback ladder, a ledger of healthy checkpoints to roll back to."""
    if cfg is ROLLBACK:
        led = CheckpointLedger()
        for s in range(0, 10_000, 500):
            led.add(s, f"ck{s}")
        return Monitor(cfg, alert_sinks=[], checkpoints=led)
    return Monitor(cfg, alert_sinks=[])


def canonical(table: pa.Table) -> pa.Table:
    """``table`` in the recorded-run schema (int64 step, float64 metrics): a run that streams."""
    cols = {"step": table.column("step").cast(pa.int64())}
    for name in table.column_names[1:]:
        if name != "tag":
            cols[name] = table.column(name).cast(pa.float64())
    return pa.table(cols)


def same_state(a: Monitor, b: Monitor) -> None:
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())
    assert a.counters == b.counters
    assert a.goodput.summary() == b.goodput.summary()
    assert a.policy.val.state_dict() == b.policy.val.state_dict()
    assert (a._lr_now, a._lr_prev, list(a._grad_hist)) == (b._lr_now, b._lr_prev,
                                                          list(b._grad_hist))


def three_ways(cfg: Any, table: pa.Table, batches: list[Any]) -> list[Any]:
    """observe() loop, whole-table replay and the stream of ``batches``: all equal."""
    a, b, c = monitor(cfg), monitor(cfg), monitor(cfg)
    loop = observe_all(a, table)
    whole = b.replay(table)
    parts = list(c.replay_stream(batches))
    assert all(isinstance(p, Decisions) for p in parts)
    assert [len(p) for p in parts] == [len(x) for x in batches]
    got = Decisions.concat(parts)
    assert len(got) == len(loop) == len(whole)
    for x, y, z in zip(loop, whole, got, strict=True):
        assert x == y == z, x.step
    same_state(a, b)
    same_state(a, c)
    return loop


@pytest.mark.parametrize("cfg", [None, CFG, ROLLBACK])
@pytest.mark.parametrize("rows", [1, 7, 250, 1 << 17])
def test_stream_equals_whole_table_and_observe_loop(monkeypatch, cfg, rows) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mr, "CHUNK_VALUES", 64)  # 1024-row chunks: boundaries in batches too
    n = 1200 if rows == 1 else 3000
    table = run_table(n, seed=rows)
    loop = three_ways(cfg, table, table.to_batches(max_chunksize=rows))
    # batch boundaries fall inside alarm episodes, the LR fault, a rollback's probation
    assert any(d.alarms for d in loop) and any(d.interventions for d in loop)
    if cfg is ROLLBACK:
        assert any(d.control.rollback_to is not None for d in loop)


def test_stream_of_batches_whose_columns_come_and_go() -> None:
    """A column absent from some batches, without nulls in others, with nulls, all null: the
    constant parts of the blocks (absent inputs, masks) are rewritten whenever they change."""
    rng = np.random.default_rng(3)
    n = 2400
    t = np.arange(n)
    loss = 2.0 + 0.02 * rng.standard_normal(n)
    loss[[700, 1500]] = np.nan  # NaN: a signal (the guard's kernel chunk)
    loss[1100] = np.inf
    g = np.exp(rng.normal(0, 0.1, (n, 2)))
    g[900, 0] = 1e4
    batches = []
    for k, lo in enumerate(range(0, n, 300)):
        sl = slice(lo, lo + 300)
        cols: dict[str, Any] = {"step": pa.array(t[sl]), "loss": pa.array(loss[sl])}
        if k % 3 != 1:  # absent from every third batch
            cols["grad_norm/a"] = pa.array(g[sl, 0], mask=(t[sl] % 5 == 0) if k % 2 else None)
        if k >= 2:  # appears late, all null in one batch
            cols["grad_norm/b"] = pa.array(g[sl, 1], mask=np.full(300, k == 4))
        if k % 4 == 3:
            cols["val_loss"] = pa.array(loss[sl] * 1.05, mask=(t[sl] % 50) != 49)
        batches.append(pa.table(cols))
    whole = pa.concat_tables(batches, promote_options="default")
    loop = three_ways(CFG, whole, batches)
    assert any(d.alarms for d in loop)
    three_ways(None, whole, batches)


def test_unsorted_or_duplicate_steps_in_a_stream_fall_back_to_observe() -> None:
    table = run_table(900, seed=4)
    steps = table.column("step").to_numpy().copy()
    steps[[100, 101]] = steps[[101, 100]]  # out of order inside a batch
    steps[400] = steps[399]  # a duplicate
    steps[600] = steps[599]  # a duplicate on a batch boundary (batches of 200 rows)
    table = table.set_column(0, "step", pa.array(steps))
    a, c = monitor(CFG), monitor(CFG)
    loop = observe_all(a, table)
    got = Decisions.concat(c.replay_stream(table.to_batches(max_chunksize=200)))
    assert list(got) == loop
    same_state(a, c)


# ------------------------------------------------------------------------------ replay_run
def write_parts(d: Path, table: pa.Table, rows: int) -> None:
    d.mkdir()
    for k, lo in enumerate(range(0, table.num_rows, rows)):
        pq.write_table(table.slice(lo, rows), d / f"part-{k:06d}.parquet")


@pytest.mark.parametrize("batch_rows", [1, 7, 1 << 17])
def test_replay_run_streams_a_sorted_run(monkeypatch, tmp_path, batch_rows) -> None:  # type: ignore[no-untyped-def]
    table = canonical(run_table(1500, seed=7))
    path = tmp_path / "run.parquet"
    pq.write_table(table, path, row_group_size=400)
    write_parts(tmp_path / "parts", table, 600)
    monkeypatch.setattr(rs, "STREAM_ROWS", batch_rows)
    sizes = []
    real = rs.RunStream.batches

    def batches(self):  # type: ignore[no-untyped-def]
        for b in real(self):
            sizes.append(b.num_rows)
            yield b

    monkeypatch.setattr(rs.RunStream, "batches", batches)
    loop = observe_all(monitor(None), table)
    events = [d for d in loop if d.alarms or d.interventions]
    for p in (path, tmp_path / "parts"):
        plan = rs.plan_stream(p, rows=batch_rows)
        assert plan is not None and sum(b.num_rows for b in plan.batches()) == 1500
        assert plan.steps.tolist() == table.column("step").to_pylist()
        sizes.clear()
        res = replay_run(p)
        assert sizes and max(sizes) <= batch_rows and sum(sizes) == 1500  # it streamed
        ref = replay_table(read_run(p), "default")
        assert res.alarms == ref.alarms == [a for d in events for a in d.alarms]
        assert res.interventions == ref.interventions == [i for d in events
                                                          for i in d.interventions]
        assert res.goodput == ref.goodput and res.n_steps == ref.n_steps == 1500
        assert res.steps.tolist() == ref.steps.tolist()


def test_replay_run_streams_parts_with_a_late_column(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = canonical(run_table(1200, seed=8))
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(table.slice(0, 500).drop(["grad_norm/late", "val_loss"]),
                   d / "part-000000.parquet")
    pq.write_table(table.slice(500), d / "part-000001.parquet")
    plan = rs.plan_stream(d, rows=128)
    assert plan is not None and plan.names == read_run(d).column_names
    res = replay_run(d, CFG)
    ref = replay_table(read_run(d), CFG)
    assert res.alarms == ref.alarms and res.interventions == ref.interventions
    assert res.alarms and res.goodput == ref.goodput


@pytest.mark.parametrize("how", ["unsorted", "duplicate", "across_parts", "int_column",
                                 "text_column"])
def test_replay_run_reads_whole_what_does_not_stream(tmp_path, how) -> None:  # type: ignore[no-untyped-def]
    """Unsorted / duplicate steps (read_run sorts and merges), other column types: no stream,
    the same result as before."""
    table = canonical(run_table(800, seed=9))
    steps = table.column("step").to_numpy().copy()
    p = tmp_path / "run.parquet"
    if how == "unsorted":
        steps[[10, 11]] = steps[[11, 10]]
    elif how == "duplicate":
        steps[300] = steps[299]
    elif how == "int_column":
        table = table.append_column("epoch", pa.array(np.arange(800, dtype=np.int32)))
    elif how == "text_column":
        table = table.append_column("tag", pa.array([f"x{k}" for k in range(800)]))
    table = table.set_column(0, "step", pa.array(steps))
    if how == "across_parts":  # the second part starts before the first ends
        p = tmp_path / "parts"
        p.mkdir()
        pq.write_table(table.slice(0, 500), p / "part-000000.parquet")
        pq.write_table(table.slice(400), p / "part-000001.parquet")
    else:
        pq.write_table(table, p)
    with pytest.warns(UserWarning) if how == "text_column" else contextlib.nullcontext():
        plan = rs.plan_stream(p, rows=100)
        if how in ("int_column", "text_column"):
            assert plan is None
        else:  # found out of order as the batches are read, before the one that is
            assert plan is not None
            seen = []
            with pytest.raises(rs.OutOfOrder):
                for b in plan.batches():
                    seen.append(b.num_rows)
            assert sum(seen) < 800
        res = replay_run(p)
        ref = replay_table(read_run(p), "default")
    assert res.alarms == ref.alarms and res.interventions == ref.interventions
    assert res.goodput == ref.goodput and res.steps.tolist() == ref.steps.tolist()


def test_replay_run_stream_with_a_projection(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A config without a catch-all input streams only the columns it binds; the unbound
    metrics warning still sees every column of the run."""
    table = canonical(run_table(700, seed=10))
    p = tmp_path / "run.parquet"
    pq.write_table(table, p)
    cfg = {"detectors": [d for d in CFG["detectors"] if d["name"] != "nan"]}
    stream, names = plan_replay(p, load_config(cfg))
    assert stream is not None and names == read_run(p).column_names
    assert stream.names == ["step", "loss", "grad_norm/a", "grad_norm/b", "grad_norm/late",
                            "val_loss"]
    res = replay_run(p, cfg)
    ref = replay_table(table, cfg)
    assert res.alarms == ref.alarms and res.interventions == ref.interventions and res.alarms
    with pytest.warns(UserWarning, match="no metric bound"):
        replay_run(p, {"detectors": [{"name": "x", "detector": "ewma_z",
                                      "inputs": ["nothing_here"]}]})


def test_progress_bar_paths_give_the_same_result(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The bar's batches (a table fed in PROGRESS_ROWS chunks, a streamed run) decide alike."""
    import replay.replay as rr

    monkeypatch.setattr(rr, "PROGRESS_ROWS", 250)
    table = canonical(run_table(1000, seed=12))
    p = tmp_path / "run.parquet"
    pq.write_table(table, p)
    ref = replay_table(table, CFG)
    bar = replay_table(table, CFG, progress=True)
    run = replay_run(p, CFG, progress=True)
    assert ref.alarms and bar.alarms == ref.alarms == run.alarms
    assert bar.interventions == ref.interventions == run.interventions
    assert "replay" in capsys.readouterr().err


def test_replay_run_stream_writes_the_same_events(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = canonical(run_table(900, seed=13))
    p = tmp_path / "run.parquet"
    pq.write_table(table, p)
    rs_ev, ref_ev = tmp_path / "stream.jsonl", tmp_path / "whole.jsonl"
    replay_run(p, CFG, events=rs_ev, run_id="r")
    replay_table(read_run(p), CFG, "r", events=ref_ev)
    got = rs_ev.read_text().splitlines()
    assert got and got == ref_ev.read_text().splitlines()


def test_stream_can_be_turned_off(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = canonical(run_table(600, seed=14))
    p = tmp_path / "run.parquet"
    pq.write_table(table, p)
    cfg = load_config("default")
    assert plan_replay(p, cfg)[0] is not None
    monkeypatch.setattr(rs, "ENABLED", False)
    assert plan_replay(p, cfg) == (None, None)
    assert replay_run(p).alarms == replay_table(table, "default").alarms


@pytest.mark.parametrize("cfg", [None, CFG])
def test_stream_tracked_column_gone_in_the_next_batch(monkeypatch, cfg) -> None:  # type: ignore[no-untyped-def]
    """The validation loss in every row of one batch, absent from the next, while an LR fault
    sends every step of that batch through the per-step tail: the tracked-slot block kept
    across the stream must not feed the previous batch's validation values."""
    monkeypatch.setattr(mr, "CHUNK_VALUES", 64)
    rng = np.random.default_rng(5)
    n, half = 2048, 1024
    t = np.arange(n)
    loss = 2.0 + 0.01 * rng.standard_normal(n)
    lr = np.where(t < half + 10, 1e-3, 1.0)  # an LR fault from step half + 10 on
    val = np.where(t == 0, 1.0, 2.0 + rng.random(n))  # every point after the first: worse
    a = pa.table({"step": t[:half], "loss": loss[:half], "lr": lr[:half], "val_loss": val[:half]})
    b = pa.table({"step": t[half:], "loss": loss[half:], "lr": lr[half:]})
    whole = pa.concat_tables([a, b], promote_options="default")
    loop = three_ways(cfg, whole, [a, b])
    assert any(d.interventions for d in loop[half:])
    mon = monitor(cfg)
    mon.replay(whole)
    assert mon.policy.val.worse_points == half - 1
