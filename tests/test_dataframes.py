"""pandas / polars dataframes into ``Monitor.replay``; alarms and interventions out as tables."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from replay.frames import alarms_table, episodes, episodes_table, interventions_table
from replay.replay import replay_table
from stability.monitor.io import is_table, table_columns
from stability.monitor.monitor import Monitor


def run_dict(n: int = 300) -> dict[str, np.ndarray]:
    """A run with a 20x loss spike at 200, a NaN loss at 250 and a grad burst at 120."""
    rng = np.random.default_rng(3)
    loss = 2.0 + 0.05 * rng.standard_normal(n)
    loss[200] = 40.0
    loss[250] = np.nan
    gn = 1.0 + 0.1 * rng.standard_normal(n)
    gn[120] = 60.0
    return {"step": np.arange(n), "loss": loss, "grad_norm": gn}


def key(decisions):
    return [(d.step, [a.to_dict() for a in d.alarms], [i.to_dict() for i in d.interventions])
            for d in decisions]


def nonfinite_steps(decisions):
    return [d.step for d in decisions for a in d.alarms if a.kind == "nonfinite"]


# ------------------------------------------------------------------------------- pandas
def test_pandas_frame_replays_like_the_dict():
    pd = pytest.importorskip("pandas")
    d = run_dict()
    ref = Monitor("default").replay(d)
    assert any(x.alarms for x in ref)
    df = pd.DataFrame(d)
    assert is_table(df)
    assert key(Monitor("default").replay(df)) == key(ref)
    # step as the index, as in df.set_index("step")
    assert key(Monitor("default").replay(df.set_index("step"))) == key(ref)
    # an extra string column is ignored, not an error
    df2 = df.assign(tag=["x"] * len(df))
    assert key(Monitor("default").replay(df2)) == key(ref)


def test_pandas_nullable_na_is_not_logged_plain_nan_is_nan():
    pd = pytest.importorskip("pandas")
    d = run_dict()
    d["loss"][250] = 2.0  # only the NA / NaN below is non-finite
    sparse = [None if i % 10 else float(v) for i, v in enumerate(d["loss"])]
    ref = Monitor("default").replay({**d, "loss": np.array(sparse, dtype=object)})
    assert nonfinite_steps(ref) == []
    na = pd.DataFrame({"step": d["step"], "grad_norm": d["grad_norm"],
                       "loss": pd.array(sparse, dtype="Float64")})
    _, cols = table_columns(na)
    present = dict((n, p) for n, _, p in cols)["loss"]
    assert present.sum() == len(d["step"]) // 10
    assert key(Monitor("default").replay(na)) == key(ref)
    # the same column as plain float64: NaN is a value, so the first gap is a nonfinite alarm
    plain = na.astype({"loss": "float64"})
    assert plain["loss"].dtype == np.float64
    assert nonfinite_steps(Monitor("default").replay(plain))[:1] == [1]
    # convert_dtypes() is the documented way back to "not logged"
    assert key(Monitor("default").replay(plain.convert_dtypes())) == key(ref)


def test_pandas_step_column_errors():
    pd = pytest.importorskip("pandas")
    with pytest.raises(ValueError, match="no 'step' column"):
        Monitor("default").replay(pd.DataFrame({"loss": [1.0, 2.0]}))
    bad = pd.DataFrame({"step": pd.array([0, None], dtype="Int64"), "loss": [1.0, 2.0]})
    with pytest.raises(ValueError, match="nulls"):
        Monitor("default").replay(bad)


# ------------------------------------------------------------------------------- polars
def test_polars_null_is_not_logged_nan_is_nan():
    pl = pytest.importorskip("polars")
    d = run_dict()
    ref = Monitor("default").replay(d)
    df = pl.DataFrame(d)
    assert is_table(df)
    assert key(Monitor("default").replay(df)) == key(ref)
    assert 250 in nonfinite_steps(ref)
    # null at 250 instead of NaN: not logged, no nonfinite alarm
    loss = [None if i == 250 else float(v) for i, v in enumerate(d["loss"])]
    df_null = df.with_columns(pl.Series("loss", loss, dtype=pl.Float64))
    assert 250 not in nonfinite_steps(Monitor("default").replay(df_null))
    ref_null = Monitor("default").replay({**d, "loss": np.array(loss, dtype=object)})
    assert key(Monitor("default").replay(df_null)) == key(ref_null)


def test_polars_batches_carry_state_and_bind_table():
    pl = pytest.importorskip("polars")
    d = run_dict()
    df = pl.DataFrame(d).with_columns(pl.Series("flag", [i % 2 == 0 for i in range(300)]))
    whole = Monitor("default").replay(df)
    batched = list(Monitor("default").replay_batches(df.iter_slices(64)))
    assert key(batched) == key(whole)
    steps, bound = Monitor("default").bind_table(df)
    steps_d, bound_d = Monitor("default").bind_table({**d, "flag": np.arange(300) % 2 == 0})
    assert steps.tolist() == steps_d.tolist() and bound.keys() == bound_d.keys()
    for name, (x, miss) in bound.items():
        np.testing.assert_array_equal(x, bound_d[name][0])
        np.testing.assert_array_equal(miss, bound_d[name][1])


# ------------------------------------------------------------------------------- tables out
def test_replay_result_tables_match_the_alarms():
    d = run_dict()
    res = replay_table(pa.table(d), "default", "r")
    assert res.alarms and res.interventions
    t = res.to_arrow()
    assert t.num_rows == len(res.alarms)
    assert t.column("step").to_pylist() == sorted(a.step for a in res.alarms)
    got = {(r["step"], r["kind"], r["signal"], r["detector"]) for r in t.to_pylist()}
    assert got == {(a.step, a.kind, a.signal, a.detector) for a in res.alarms}
    for r, a in zip(t.to_pylist(), sorted(res.alarms, key=lambda a: a.step), strict=True):
        assert r["score"] == a.score or (math.isnan(r["score"]) and math.isnan(a.score))
    causes = {i.step: i.cause for i in res.interventions if i.cause}
    assert {r["step"]: r["cause"] for r in t.to_pylist() if r["cause"]} == {
        r["step"]: causes[r["step"]] for r in t.to_pylist() if r["step"] in causes}
    iv = res.to_arrow("interventions")
    assert iv.column("type").to_pylist() == [i.type for i in res.interventions]
    eps = res.to_arrow("episodes")
    assert sum(eps.column("alarms").to_pylist()) == len(res.alarms)
    with pytest.raises(ValueError, match="which"):
        res.to_arrow("nope")
    page = res._repr_html_()
    assert page.startswith("<table>") and f"{eps.num_rows} episodes" in page


def test_tables_from_monitor_decisions_and_pandas_round_trip():
    pd = pytest.importorskip("pandas")
    d = run_dict()
    decisions = Monitor("default").replay(pd.DataFrame(d))
    alarms = [a for x in decisions for a in x.alarms]
    t = alarms_table(decisions)
    df = t.to_pandas()
    assert len(df) == len(alarms) and list(df.columns)[:3] == ["step", "kind", "signal"]
    # the table round-trips back through the dict form of the alarms
    assert alarms_table([r for r in df.to_dict("records")]).to_pylist() == t.to_pylist()
    ivs = interventions_table(decisions)
    assert ivs.num_rows == sum(len(x.interventions) for x in decisions)
    res = replay_table(pa.table(d), "default")
    assert res.to_pandas("interventions").shape[0] == ivs.num_rows


def test_episodes_group_by_gap_and_pick_the_peak():
    recs = [
        {"step": 10, "kind": "loss_spike", "signal": "loss", "score": 7.0},
        {"step": 10, "kind": "grad_explosion", "signal": "grad_norm", "score": 9.5},
        {"step": 14, "kind": "loss_spike", "signal": "loss", "score": 30.0},
        {"step": 200, "kind": "nonfinite", "signal": "loss", "score": "inf"},
        {"step": 14, "type": "reduce_lr", "cause": "lr", "factor": 0.5},
        {"step": 90, "type": "checkpoint"},
    ]
    eps = episodes(recs, gap=25)
    assert [(e["first_step"], e["last_step"]) for e in eps] == [(10, 14), (200, 200)]
    e0, e1 = eps
    assert e0["first_score"] == 9.5 and e0["peak_score"] == 30.0 and e0["peak_step"] == 14
    assert e0["kinds"] == {"loss_spike": 2, "grad_explosion": 1}
    assert e0["cause"] == "lr" and e0["interventions"] == {"reduce_lr": 1}
    assert e1["peak_score"] == math.inf and e1["interventions"] == {}
    t = episodes_table(recs, gap=25)
    assert t.column("kinds").to_pylist()[0] == "loss_spike x2, grad_explosion"
    assert len(episodes(recs, gap=1000)) == 1
