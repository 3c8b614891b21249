"""The replay's fast path (issue 17): Arrow buffers decoded in place, chunked bank kernels, quiet
steps counted in bulk, the LR / loss followed in bulk -- all equal to a loop of ``observe()``."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from stability import Monitor
from stability.monitor import replay as mr
from stability.monitor.io import table_columns
from stability.monitor.replay import Decisions
from stability.outputs.events import read_events
from stability.policy.loss_tracker import LossTracker
from stability.policy.lr_guard import LRGuard, LRGuardConfig
from stability.policy.policy import Policy
from stability.run.goodput import GoodputTracker
from stability.types import Control

CFG = {"detectors": [
    {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "grad_layers", "detector": "ewma_z", "inputs": ["grad_norm/*"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "tv", "detector": "train_val", "inputs": ["loss", "val_loss"]},
]}


def run_table(n: int = 3000, seed: int = 0) -> pa.Table:
    """A run with everything the tail reacts to: loss spikes, NaN / inf, an LR fault that
    starts and ends, sparse validation, a layer that appears late, nulls."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    loss = 2.0 + 1.0 / np.sqrt(1 + t / 50) + 0.02 * rng.standard_normal(n)
    at = [int(n * f) for f in (0.23, 0.5, 0.73, 0.6, 0.83, 0.33, 0.43, 0.47, 0.3, 0.4)]
    loss[at[:3]] *= 30.0
    loss[at[3]] = np.nan
    loss[at[4]] = np.inf
    lr = np.where(t < 40, 1e-3 * (t + 1) / 40, 1e-3 * np.cos(t / n))
    lr[at[5]:at[5] + 60] *= 40.0   # an LR fault that ends
    lr[at[6]] = np.nan             # ignored by the guard
    lr[at[7]] = -1.0
    g = np.exp(rng.normal(0, 0.1, (n, 3)))
    g[at[8], 1] = 1e4
    cols = {"step": pa.array(t * 2 + 5), "train/loss": pa.array(loss),
            "lr": pa.array(lr, mask=(t % 7) == 3),
            "grad_norm": pa.array(np.exp(rng.normal(0, 0.1, n))),
            "grad_norm/a": pa.array(g[:, 0]), "grad_norm/b": pa.array(g[:, 1]),
            "grad_norm/late": pa.array(g[:, 2], mask=t < at[9]),
            "val_loss": pa.array(loss * 1.05, mask=(t % 50) != 49),
            "n_tokens": pa.array(t.astype(np.int32)), "tag": pa.array([str(x) for x in t])}
    return pa.table(cols)


def observe_all(mon: Monitor, table: pa.Table) -> list:
    steps, cols = table_columns(table)
    return [mon.observe(int(steps[k]), {n: float(v[k]) for n, v, p in cols if p[k]})
            for k in range(len(steps))]


def same_run(table, cfg=None, **kw) -> tuple[Monitor, Monitor, list, Decisions]:  # type: ignore[no-untyped-def]
    a, b = Monitor(cfg, alert_sinks=[], **kw), Monitor(cfg, alert_sinks=[], **kw)
    loop = observe_all(a, table)
    got = b.replay(table)
    assert isinstance(got, Decisions) and len(got) == len(loop)
    for x, y in zip(loop, got, strict=True):
        assert x == y, x.step
    assert got == loop and loop == got
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())
    assert a.counters == b.counters
    assert a.goodput.summary() == b.goodput.summary()
    assert (a._lr_now, a._lr_prev, list(a._grad_hist)) == (b._lr_now, b._lr_prev,
                                                          list(b._grad_hist))
    return a, b, loop, got


@pytest.mark.parametrize("chunk_values", [64, 1 << 20])
@pytest.mark.parametrize("cfg", [None, CFG])
def test_replay_equals_observe_loop(monkeypatch, cfg, chunk_values) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mr, "CHUNK_VALUES", chunk_values)  # 1024-row chunks, or one chunk
    _, _, loop, got = same_run(run_table(), cfg)
    assert any(d.interventions for d in loop) and any(d.alarms for d in loop)
    assert [d.step for d in got.events()] == [d.step for d in loop
                                              if d.alarms or d.interventions]


def test_replay_in_log_only_mode_and_with_the_guard_off() -> None:
    table = run_table(1500, seed=1)
    same_run(table, {**CFG, "monitor": {"log_only": True}})
    same_run(table, {**CFG, "policy": {"lr_guard": {"enabled": False}}})


def test_sparse_lr_between_alarms() -> None:
    """Bulk segments holding one logged LR each (the monitor keeps the last two)."""
    t = np.arange(400)
    loss = 2.0 + 0.01 * np.sin(t)
    loss[t % 40 == 10] = np.nan
    lr = np.where(t % 20 == 0, 1e-3 * (1 + t / 400), np.nan)
    same_run(pa.table({"step": t, "loss": loss, "lr": pa.array(lr, mask=t % 20 != 0)}), CFG)


def test_arrow_layouts_chunks_offsets_and_types() -> None:
    """Multi-chunk columns, sliced arrays (buffer offsets, bitmaps not byte-aligned), integer,
    float32 and boolean columns decode like table_columns; strings are ignored."""
    table = run_table(700, seed=2)
    base = Monitor(CFG, alert_sinks=[]).replay(table)
    chunked = pa.concat_tables([table.slice(0, 333), table.slice(333)])
    assert chunked.column("train/loss").num_chunks == 2
    assert Monitor(CFG, alert_sinks=[]).replay(chunked) == base
    sl = table.slice(13, 500)  # an offset of 13 rows into every buffer
    a, b = Monitor(CFG, alert_sinks=[]), Monitor(CFG, alert_sinks=[])
    assert b.replay(sl) == observe_all(a, sl)
    batch = sl.to_batches()[0]
    assert Monitor(CFG, alert_sinks=[]).replay(batch) == observe_all(Monitor(CFG), sl)
    typed = pa.table({"step": pa.array(np.arange(50), pa.int32()),
                      "loss": pa.array(np.linspace(1, 2, 50), pa.float32()),
                      "grad_norm/x": pa.array([bool(k % 2) for k in range(50)]),
                      "grad_norm/y": pa.array(list(range(49)) + [None], pa.int64())})
    same_run(typed, CFG)


def test_decode_matches_table_columns() -> None:
    table = run_table(300, seed=3).slice(7)
    steps, cols = mr.decode_table(table)
    ref_steps, ref = table_columns(table)
    assert np.array_equal(steps, ref_steps)
    assert [n for n, _ in cols] == [n for n, _, _ in ref]
    for (_, (v, p)), (_, rv, rp) in zip(cols, ref, strict=True):
        pres = np.ones(len(v), dtype=np.bool_) if p is None else p
        assert np.array_equal(pres, rp)
        assert np.array_equal(v[pres], rv[rp], equal_nan=True)


def test_two_names_for_one_signal_later_column_wins() -> None:
    t = pa.table({"step": [0, 1, 2, 3], "train/loss": [1.0, 2.0, None, 4.0],
                  "loss": [None, 5.0, 3.0, None]})
    same_run(t, CFG)


def test_goodput_records_in_the_event_log_match(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = run_table(800, seed=4)
    recs = []
    for name, how in (("loop", "observe"), ("replay", "replay")):
        path = tmp_path / f"{name}.jsonl"
        mon = Monitor({**CFG, "event_log": {"path": str(path), "goodput_every": 37}},
                      alert_sinks=[])
        if how == "observe":
            observe_all(mon, table)
        else:
            mon.replay(table)
        mon.close()
        recs.append([{k: v for k, v in r.items() if k not in ("time", "wall")}
                     for r in read_events(path)])
    assert recs[0] == recs[1]
    assert sum(r["type"] == "goodput" for r in recs[0]) == 800 // 37 + 1


def test_replay_of_batches_and_iterables_concatenates() -> None:
    table = run_table(900, seed=5)
    ref = Monitor(CFG, alert_sinks=[]).replay(table)
    got = Monitor(CFG, alert_sinks=[]).replay(table.to_batches(max_chunksize=250))
    assert isinstance(got, Decisions) and got == ref
    assert list(Monitor(CFG, alert_sinks=[]).replay_batches(table.to_batches(100))) == list(ref)


def test_decisions_sequence() -> None:
    d = Monitor(CFG, alert_sinks=[]).replay(run_table(200, seed=6))
    items = list(d)
    assert len(d) == 200 and d[-1] == items[-1] and d[0] == items[0]
    assert d[10:20] == items[10:20] and d[::-7] == items[::-7]
    assert d + [] == items and [] + d == items
    assert d.steps.tolist() == [x.step for x in items]
    with pytest.raises(IndexError):
        d[200]
    quiet = [x for x in items if not (x.alarms or x.interventions)]
    assert quiet[0].control is quiet[1].control  # shared snapshot, as in observe()
    both = Decisions.concat([d, Decisions.from_list(items)])
    assert list(both) == items + items and "200 steps" in repr(d)
    assert d != items[:-1] and d != 3


# ------------------------------------------------------------- the bulk methods against loops
LR_CASES = [
    [1e-3] * 40 + [1e-2] + [1e-3] * 5,
    [1e-4 * (k + 1) for k in range(30)] + [3e-3] * 30 + [9e-3],
    [1e-3, math.nan, 0.0, -1.0, 1e-3, math.inf] * 8 + [5e-2],
    [1e-3 * (1 + 0.3 * math.sin(k / 3)) for k in range(200)],
]


@pytest.mark.parametrize("restarts", [False, True])
@pytest.mark.parametrize("lrs", LR_CASES)
def test_lr_guard_observe_healthy_equals_observe_loop(lrs, restarts) -> None:  # type: ignore[no-untyped-def]
    cfg = LRGuardConfig(allow_restarts=restarts, settle=4)
    for cut in (1, 3, 17):
        a, b = LRGuard(cfg), LRGuard(cfg)
        for s, lr in enumerate(lrs[:cut]):
            a.observe(s, lr)
            b.observe(s, lr)
        rest = lrs[cut:]
        k = b.observe_healthy(np.array(rest))
        for s, lr in enumerate(rest[:k], cut):
            a.observe(s, lr)
            assert not a.active
        assert a.state_dict() == b.state_dict()
        if k < len(rest):  # the next LR starts a fault
            a.observe(cut + k, rest[k])
            assert a.active


def test_loss_tracker_update_many_equals_loop() -> None:
    rng = np.random.default_rng(7)
    v = np.exp(rng.normal(0.5, 0.3, 300))
    v[[5, 6, 50]] = [np.nan, np.inf, -np.inf]
    v[[80, 81]] = [0.0, -2.0]
    q = rng.random(300) < 0.7
    a, b = LossTracker(), LossTracker()
    probe = [0, 5, 6, 7, 80, 150, 299, 300]
    seen = []
    for k, (x, qq) in enumerate(zip(v, q, strict=True)):
        seen += [a.fast] * probe.count(k)
        a.update(float(x), bool(qq))
    seen.append(a.fast)  # probe 300: after the last loss
    got = b.update_many(v, q, probe=probe)
    assert a.state_dict() == b.state_dict()
    assert np.array_equal(got, np.array(seen), equal_nan=True)
    c = LossTracker()
    c.update_many(np.array([np.nan, np.inf]), np.array([True, True]))
    c.update_many([], [])
    assert c.nonfinite_run == 2 and math.isnan(c.fast)


def test_policy_track_many_equals_track_loop() -> None:
    rng = np.random.default_rng(8)
    n = 400
    steps = np.arange(n)
    lr = np.full(n, 1e-3)
    lr[300] = 1.0
    loss = np.exp(rng.normal(0.5, 0.1, n))
    lp = rng.random(n) < 0.9
    lp[78:83] = True  # around the end of the cooldown (step 80)
    vp = steps % 25 == 24
    a, b = Policy({}), Policy({})
    for p in (a, b):
        p._ep.last_seen = 60  # an episode ended there: the baseline waits out the cooldown
    ones = np.ones(n, dtype=np.bool_)
    assert b.track_many(steps, (lr, ones), (loss, lp)) == 0  # the guard primes in track()
    for p in (a, b):
        p.track(0, float(lr[0]), float(loss[0]), Control())
    k = 1 + b.track_many(steps[1:], (lr[1:], ones[1:]), (loss[1:], lp[1:]),
                         (loss[1:] * 1.1, vp[1:]))
    assert k == 300
    for s in range(1, k):
        assert a.track(s, float(lr[s]), float(loss[s]) if lp[s] else None, Control(),
                       float(loss[s] * 1.1) if vp[s] else None) == []
    assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())


def test_goodput_update_many_equals_loop() -> None:
    a, b = GoodputTracker(auto_start=False), GoodputTracker(auto_start=False)
    steps = np.arange(3, 40_000, 2)
    for s in steps.tolist():
        a.update(s, degraded=True)
    b.update_many(steps, degraded=True)
    assert a.state_dict() == b.state_dict()
    a.note_rollback(39_999, 30_001)
    b.note_rollback(39_999, 30_001)
    assert a.summary() == b.summary()


def test_replay_run_reads_only_the_bound_columns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pyarrow.parquet as pq

    from replay.replay import read_bound, replay_run, replay_table

    table = run_table(600, seed=9)
    path = tmp_path / "run.parquet"
    pq.write_table(table, path)
    cfg = {"detectors": [d for d in CFG["detectors"] if d["name"] != "nan"]}
    got, names = read_bound(path, cfg)
    assert got.column_names == ["step", "loss", "grad_norm/a", "grad_norm/b", "grad_norm/late",
                                "val_loss"]
    assert "n_tokens" in names and "lr" in names
    full = replay_table(table, cfg)
    res = replay_run(path, cfg)
    assert res.alarms == full.alarms and res.interventions == full.interventions
    assert res.alarms and res.goodput == full.goodput
    assert read_bound(path, CFG)[0].column_names == names  # a catch-all input binds them all


def test_nonfinite_guard_skips_the_input_copy_on_finite_chunks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The guard's finite chunks (masks alone) and non-finite ones (its kernel) alternate:
    the decisions and the state are those of the observe() loop."""
    from detectors.nonfinite import NonFiniteGuard

    monkeypatch.setattr(mr, "CHUNK_VALUES", 1)  # 1024-row chunks
    calls = {"masks": 0, "kernel": 0}
    masks, kernel = NonFiniteGuard.update_finite_many, NonFiniteGuard.update_many_array

    def spy_masks(self, *a):  # type: ignore[no-untyped-def]
        calls["masks"] += 1
        return masks(self, *a)

    def spy_kernel(self, *a):  # type: ignore[no-untyped-def]
        calls["kernel"] += 1
        return kernel(self, *a)

    monkeypatch.setattr(NonFiniteGuard, "update_finite_many", spy_masks)
    monkeypatch.setattr(NonFiniteGuard, "update_many_array", spy_kernel)
    # finite chunk, non-finite chunks (lr NaN, loss NaN, loss inf, one early in the chunk
    # before the last), then a finite one
    table = run_table(4200)
    k = table.column_names.index("train/loss")
    loss = table.column(k).to_numpy().copy()
    loss[3 * 1024 + 10] = np.nan
    table = table.set_column(k, "train/loss", pa.array(loss))
    same_run(table, CFG)
    assert calls["masks"] >= 2 and calls["kernel"] >= 3
