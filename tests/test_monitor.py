from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stability import Control, Monitor
from stability.monitor.io import table_columns
from tests.shared_data import PUBLIC_RUNS

RUNS = PUBLIC_RUNS
needs_runs = pytest.mark.skipif(not RUNS.exists(), reason="shared runs not available")

SMALL = {"detectors": [
    {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "grad_layers", "detector": "ewma_z", "inputs": ["grad_norm/*"],
     "params": {"warmup": 5, "alpha": 0.1}},
    {"name": "tv", "detector": "train_val", "inputs": ["loss", "val_loss"]},
]}


def load(run: str) -> pa.Table:
    return pq.read_table(RUNS / f"{run}.parquet")


def rows(table):
    steps, cols = table_columns(table)
    for t in range(len(steps)):
        yield int(steps[t]), {n: float(v[t]) for n, v, p in cols if p[t]}


def observe_all(mon, table):
    return [mon.observe(s, m) for s, m in rows(table)]


def stream(n=200, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        m = {"loss": float(np.exp(rng.normal(0.7, 0.02))), "lr": 1e-3,
             "grad_norm/a": float(np.exp(rng.normal(0, 0.05))),
             "grad_norm/b": float(np.exp(rng.normal(0, 0.05)))}
        if s % 10 == 0:
            m["val_loss"] = m["loss"] * 1.05
        out.append(m)
    if n > 150:
        out[120]["loss"] = 50.0
        out[150]["grad_norm/b"] = float("nan")
    return out


# ---------------------------------------------------------------- real runs: identity & state
# 0000 gpt act shift, 0009 inf, 0014 grad explosion + lr, 0022 train/val, 0029 lr + nonfinite
IDENTITY_RUNS = ["public_0000", "public_0009", "public_0014", "public_0022", "public_0029"]


@needs_runs
def test_replay_identical_to_observe_loop_on_real_runs():
    fired = set()
    for run in IDENTITY_RUNS:
        table = load(run)
        a, b = Monitor(), Monitor()
        loop = observe_all(a, table)
        batch = b.replay(table)
        assert len(loop) == len(batch) == table.num_rows
        for x, y in zip(loop, batch, strict=True):
            assert x == y, (run, x.step)
        assert json.dumps(a.state_dict()) == json.dumps(b.state_dict())
        fired |= {al.detector for d in loop for al in d.alarms}
    # every detector family present in the default preset alarmed somewhere
    for name in ("nonfinite", "loss_spike", "loss_spike_robust", "grad_explosion",
                 "grad_explosion_layers", "update_ratio_layers", "activation_shift", "train_val",
                 "val_spike", "lr_jump", "lr_loss_corr", "loss_level_shift"):
        assert name in fired, name


@needs_runs
def test_replay_batches_and_dict_columns_match():
    table = load("public_0014")
    ref = Monitor().replay(table)
    mon = Monitor()
    got = list(mon.replay_batches(table.to_batches(max_chunksize=333)))
    assert got == ref
    cols = {}
    for name in table.column_names:
        c = table.column(name)
        if pa.types.is_floating(c.type) and c.null_count:
            cols[name] = np.ma.masked_array(c.to_numpy(zero_copy_only=False), c.is_null().to_numpy(
                zero_copy_only=False))
        else:
            cols[name] = c.to_numpy(zero_copy_only=False)
    assert Monitor().replay(cols) == ref


@needs_runs
@pytest.mark.parametrize("run", ["public_0029", "public_0000"])
def test_state_round_trip_mid_run_is_bit_identical(run):
    table = load(run)
    data = list(rows(table))
    ref = Monitor()
    full = [ref.observe(s, m) for s, m in data]
    for split in (1, 350, 765, len(data) - 3):
        mon = Monitor()
        head = [mon.observe(s, m) for s, m in data[:split]]
        sd = json.loads(json.dumps(mon.state_dict(), allow_nan=False))
        fresh = Monitor()
        fresh.load_state_dict(sd)
        tail = [fresh.observe(s, m) for s, m in data[split:]]
        assert head + tail == full, split
    # replay continues from a restored state too
    mon = Monitor()
    mon.replay(table.slice(0, 600))
    fresh = Monitor()
    fresh.load_state_dict(json.loads(json.dumps(mon.state_dict())))
    assert fresh.replay(table.slice(600)) == full[600:]


def test_state_dict_rejects_other_bindings_and_versions():
    sd = Monitor(SMALL).state_dict()
    with pytest.raises(ValueError, match="bindings"):
        Monitor().load_state_dict(sd)
    with pytest.raises(ValueError, match="version"):
        Monitor(SMALL).load_state_dict({**sd, "version": 99})


# ---------------------------------------------------------------- families fast path
def test_families_identical_to_keys():
    rng = np.random.default_rng(1)
    layers = [f"blk{i}" for i in range(6)]
    stats = ("act_mean", "act_std", "act_absmax", "act_kurtosis", "grad_norm", "update_ratio")
    fam_mon, key_mon = Monitor(), Monitor()
    for f in stats:
        fam_mon.declare_family(f, layers)
    out_f, out_k = [], []
    for s in range(300):
        vals = np.exp(rng.normal(0, 0.05, (len(stats), len(layers))))
        vals[0] -= 1.0
        if s == 200:
            vals[4, 2] *= 100.0
        if s == 250:
            vals[1, 3] = np.nan
        scal = {"loss": float(np.exp(rng.normal(0.5, 0.02))), "lr": 1e-3,
                "grad_norm": float(vals[4].sum())}
        if s % 25 == 0:
            scal["val_loss"] = scal["loss"]
        keys = dict(scal)
        for k, f in enumerate(stats):
            keys.update({f"{f}/{x}": float(vals[k, j]) for j, x in enumerate(layers)})
        out_k.append(key_mon.observe(s, keys))
        out_f.append(fam_mon.observe(s, scal, families={f: vals[k] for k, f in enumerate(stats)}))
    assert out_f == out_k
    assert any(d.alarms for d in out_f)
    assert [a.kind for a in out_f[250].alarms] == ["nonfinite"]
    assert fam_mon.families["grad_norm"] == layers


def test_family_bad_inputs_are_recorded():
    mon = Monitor(SMALL)
    mon.declare_family("grad_norm", ["a", "b"])
    d = mon.observe(0, {"loss": 1.0}, families={"grad_norm": np.ones(3), "nope": np.ones(2)})
    assert len(d.skipped) == 2 and "shape (3,)" in d.skipped[0] and "not declared" in d.skipped[1]
    d = mon.observe(1, {}, families={"grad_norm": np.array(["x", "y"])})
    assert "not numeric" in d.skipped[0]
    assert mon.series("grad_layers") == ["a", "b"]
    with pytest.raises(ValueError, match="unique"):
        mon.declare_family("x", ["a", "a"])


# ---------------------------------------------------------------- input policy
BAD_VALUES = ["abc", b"1.0", "1.5", np.zeros(3), object(), [1.0, 2.0], {"a": 1}, complex(1, 2),
              10**400, np.array(["x"])]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=lambda v: type(v).__name__)
def test_bad_values_are_skipped_never_poison(bad):
    data = stream()
    ref, mon = Monitor(SMALL), Monitor(SMALL)
    for s, m in enumerate(data):
        mm = dict(m)
        if s == 60:
            mm["loss"] = bad
            del m["loss"]  # reference: the value was simply missing
        d = mon.observe(s, mm)
        r = ref.observe(s, m)
        if s == 60:
            assert len(d.skipped) == 1 and d.skipped[0].startswith("metrics['loss']")
            assert d.alarms == r.alarms
        else:
            assert d == r
    assert json.dumps(mon.state_dict()) != ""
    strict = Monitor({**SMALL, "monitor": {"strict": True}})
    strict.observe(0, {"loss": 1.0})
    with pytest.raises(ValueError, match="metrics\\['loss'\\]"):
        strict.observe(1, {"loss": bad})


def test_none_means_missing_and_accepted_value_types():
    mon = Monitor(SMALL)
    d = mon.observe(0, {"loss": None, "val_loss": None, "grad_norm/a": np.float32(1.0),
                        "grad_norm/b": np.array(2.0)})
    assert d.skipped == () and d.healthy
    assert np.isnan(mon.detector("loss_spike").score).all()  # None = missing, not NaN
    d = mon.observe(1, {"loss": np.array([1.5]), "grad_norm/a": 3, "grad_norm/b": True})
    assert d.skipped == ()
    assert mon.detector("loss_spike").score.tolist() == [0.0]


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_torch_values_without_importing_in_stability():
    torch = pytest.importorskip("torch")
    mon, ref = Monitor(SMALL), Monitor(SMALL)
    mon.declare_family("grad_norm", ["a", "b"])
    ref.declare_family("grad_norm", ["a", "b"])
    for s in range(30):
        x = 1.0 + 0.01 * (s % 4)
        w = torch.tensor(x, requires_grad=True) * 1.0
        d = mon.observe(s, {"loss": w}, families={"grad_norm": torch.tensor([x, x])})
        r = ref.observe(s, {"loss": x}, families={"grad_norm": np.array([x, x])})
        assert d == r
    d = mon.observe(30, {"loss": torch.ones(3)})
    assert "shape (3,)" in d.skipped[0]


def test_nonfinite_gives_one_critical_alarm_per_signal():
    mon = Monitor(SMALL)
    for s, m in enumerate(stream()[:100]):
        mon.observe(s, m)
    d = mon.observe(100, {"loss": float("inf"), "val_loss": float("nan"),
                          "grad_norm/a": float("-inf"), "grad_norm/b": 1.0})
    assert sorted((a.detector, a.signal) for a in d.alarms) == [
        ("nan", "grad_norm/a"), ("nan", "loss"), ("nan", "val_loss")]
    assert all(a.severity == "critical" and a.kind == "nonfinite" for a in d.alarms)
    assert "is +inf" in next(a for a in d.alarms if a.signal == "loss").message
    # NaN never entered the state: the next finite step is healthy
    assert mon.observe(101, {"loss": 2.0, "grad_norm/a": 1.0, "grad_norm/b": 1.0}).healthy


def test_huge_values_and_unknown_names():
    mon = Monitor()
    for s in range(60):
        mon.observe(s, {"loss": 2.0 + 0.01 * (s % 3), "grad_norm": 1.0, "my_custom": 1e308,
                        "weird name ✓": -1e308})
    d = mon.observe(60, {"loss": 1e308, "grad_norm": 1e308})
    assert {a.kind for a in d.alarms} >= {"loss_spike", "grad_explosion"}
    json.dumps(mon.state_dict(), allow_nan=False)
    mon2 = Monitor({"detectors": [SMALL["detectors"][1]]})
    d = mon2.observe(0, {"unknown/metric": 1.0, 7: 1.0, "loss": 1.0})
    assert "unknown/metric" in mon2.unbound and "metric names must be strings" in d.skipped[0]


@pytest.mark.parametrize("step", [-1, "3", 2.5, None, True, float("nan")])
def test_bad_steps_are_skipped(step):
    mon = Monitor(SMALL)
    d = mon.observe(step, {"loss": 1.0})
    assert d.skipped and not d.alarms and mon.last_step == -1
    assert mon.detector("loss_spike").n_series == 0
    with pytest.raises(ValueError, match="step"):
        Monitor({**SMALL, "monitor": {"strict": True}}).observe(step, {"loss": 1.0})


def test_duplicate_and_out_of_order_steps_are_not_fed():
    mon = Monitor(SMALL)
    for s in range(10):
        mon.observe(s, {"loss": 1.0 + 0.01 * s})
    before = json.dumps(mon.state_dict())
    for s in (9, 3):
        d = mon.observe(s, {"loss": 100.0})
        assert "duplicate or out of order" in d.skipped[0] and not d.alarms
    after = json.loads(json.dumps(mon.state_dict()))
    after["counters"] = json.loads(before)["counters"]
    assert json.dumps(after) == before  # only the counters changed
    assert mon.counters["skipped_steps"] == 2
    mon.observe(np.int64(10), {"loss": 1.1})
    mon.rewind(5)
    assert not mon.observe(6, {"loss": 1.1}).skipped


def test_replay_with_non_increasing_steps_matches_loop():
    data = stream(80)
    steps = list(range(40)) + [39, 38] + list(range(40, 78))
    cols = {"step": np.array(steps), "loss": np.array([m["loss"] for m in data])}
    a, b = Monitor(SMALL), Monitor(SMALL)
    loop = [a.observe(int(s), {"loss": float(v)}) for s, v in zip(cols["step"], cols["loss"],
                                                                  strict=True)]
    assert b.replay(cols) == loop
    assert sum(bool(d.skipped) for d in loop) == 2


def test_layers_appearing_late_grow_the_bank():
    data = stream(200)
    mon, ref = Monitor(SMALL), Monitor(SMALL)
    for s, m in enumerate(data):
        mm = dict(m)
        if s >= 100:
            mm["grad_norm/late"] = 1.0 + 0.01 * (s % 2)
        mon.observe(s, mm)
        ref.observe(s, m)
        if s == 99:
            assert mon.series("grad_layers") == ["a", "b"]
        got, want = mon.detector("grad_layers").score[:2], ref.detector("grad_layers").score
        assert np.array_equal(got, want, equal_nan=True)
    assert mon.series("grad_layers") == ["a", "b", "late"]
    assert mon.detector("grad_layers").n_series == 3


def test_sparse_val_and_missing_metrics():
    mon = Monitor(SMALL)
    decisions = [mon.observe(s, m) for s, m in enumerate(stream())]
    assert all(not d.skipped for d in decisions)
    assert mon.series("tv") == [""]
    # a step without val_loss is missing for train_val, not NaN (no nonfinite alarm)
    assert not any(a.kind == "nonfinite" and a.signal == "val_loss"
                   for d in decisions for a in d.alarms)
    assert [a.signal for a in decisions[120].alarms] == ["loss"]


def test_aliases_default_and_configured():
    cfg = {**SMALL, "monitor": {"aliases": {"objective": "loss", "gn/*": "grad_norm/*"}}}
    canon, alias = Monitor(cfg), Monitor(cfg)
    names = {"loss": "train/loss", "grad_norm/a": "grad-norm/a", "grad_norm/b": "gn/b",
             "val_loss": "eval/loss", "lr": "learning_rate"}
    for s, m in enumerate(stream()):
        other = {names[k]: v for k, v in m.items()}
        if s % 2:
            other["objective"] = other.pop("train/loss")
        assert canon.observe(s, m) == alias.observe(s, other)
    assert alias.signals == canon.signals
    m = Monitor({"detectors": [SMALL["detectors"][1]]})
    m.observe(0, {"lm loss": 2.0})
    m.observe(1, {"lm_loss": 2.0})
    assert m.signals == ["loss"]


# ---------------------------------------------------------------- policy, control, log-only
@needs_runs
def test_log_only_records_interventions_but_control_stays_neutral():
    table = load("public_0014")
    cfg = {"preset": "default", "monitor": {"log_only": True}}
    decisions = Monitor(cfg).replay(table)
    assert sum(len(d.interventions) for d in decisions) > 0
    neutral = Control()
    assert all(d.control == neutral for d in decisions)
    acting = Monitor().replay(table)
    assert any(d.control != neutral for d in acting)
    assert observe_all(Monitor(cfg), table) == decisions


@needs_runs
def test_per_step_control_fields_reset_and_context():
    table = load("public_0029")
    seen = []

    mon = Monitor()
    orig = mon.policy.step

    def spy(step, alarms, control, context=None):
        if alarms:
            seen.append(dict(context))
        return orig(step, alarms, control, context)

    mon.policy.step = spy
    decisions = observe_all(mon, table)
    skips = [i for i, d in enumerate(decisions) if d.control.skip_step]
    assert skips
    assert any(not decisions[i + 1].control.skip_step for i in skips if i + 1 < len(decisions))
    assert all("grad_norm_recent_median" in c and "healthy_checkpoints" in c for c in seen[1:])


def test_handlers_event_log_and_alert_sinks(tmp_path):
    from stability.outputs.events import EventLog, read_events

    sent = []

    class Sink:
        def send(self, alert):
            sent.append(alert)

    def boom(_):
        raise RuntimeError("user bug")

    log = EventLog(tmp_path / "ev.jsonl")
    mon = Monitor(SMALL, event_log=log, alert_sinks=Sink(), on_alarm=boom, on_intervention=[boom])
    for s, m in enumerate(stream()):
        mon.observe(s, m)
    log.close()
    assert mon.handlers.n_errors > 0
    kinds = {e["type"] for e in read_events(tmp_path / "ev.jsonl")}
    assert {"alarm", "intervention"} <= kinds
    assert sent
    strict = Monitor({**SMALL, "monitor": {"strict": True}}, on_alarm=boom)
    with pytest.raises(RuntimeError, match="user bug"):
        for s, m in enumerate(stream()):
            strict.observe(s, m)
