"""The fused monitor step (:mod:`stability.monitor.fused`) equals the plain path bit for bit.

The plain path is :func:`~stability.monitor.fused.reference_step`: the gather, then one
``update_array`` per active bank.  Two monitors with the same config see the same random stream
(missing values, NaN / +-inf, spikes, families re-declared with more layers, keyed layers that
appear late, an LR fault, a state round trip, a rewind); one is forced onto the plain path.
Every step's decision, every bank's scores / alarms / state and the final snapshots must be
identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from numba import config as numba_config
from numba import njit

from detectors.dispatch import interpreted
from stability import Monitor
from stability.monitor.binding import gather_step
from stability.monitor.fused import build_fused_plan, fused_step, gather_runs, reference_step

EXTRA = [  # the kernels the default preset does not bind
    {"name": "loss_adwin", "detector": "adwin", "inputs": ["loss"]},
    {"name": "gn_cusum", "detector": "cusum", "inputs": ["grad_norm"]},
    {"name": "act_hist", "detector": "histogram_drift", "inputs": ["act_std/*"],
     "params": {"window": 32}},
    {"name": "loss_no_progress", "detector": "no_progress", "inputs": ["loss"],
     "params": {"horizon": 30, "window": 10}},
    # log-space EWMAs beside the grad-norm banks that read logs (the preset's grad_explosion*
    # are tail_z, which computes its own logs): two log groups, so the shared log row is used
    {"name": "gn_layers_ewma", "detector": "ewma_z", "inputs": ["grad_norm/*"],
     "params": {"log_space": True}},
    {"name": "gn_ewma", "detector": "ewma_z", "inputs": ["grad_norm"],
     "params": {"log_space": True}},
]
pytestmark = pytest.mark.skipif(numba_config.DISABLE_JIT,
                                reason="JIT disabled: the monitor takes the plain path")

CONFIG = {"preset": "default", "detectors": EXTRA,
          "policy": {"cooldown": 5}}
SCALARS = ("loss", "lr", "grad_norm", "param_norm", "loss_scale", "tokens_per_s")
FAMS = ("act_mean", "act_std", "act_absmax", "grad_norm")


class PlainMonitor(Monitor):
    """A monitor that always takes the plain (reference) path."""

    def _relayout(self) -> None:
        super()._relayout()
        self._fused = None


def _stream(steps: int, seed: int) -> list[tuple[dict, dict, int]]:
    """``(metrics, families, n_layers)`` per step: noise with holes, non-finite values, spikes
    and a growing number of layers."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        n_layers = 3 if t < 60 else (5 if t < 140 else 8)
        m: dict = {}
        for k, name in enumerate(SCALARS):
            r = rng.random()
            if r < 0.08:
                continue                       # not logged this step
            v = float(np.exp(rng.normal(0.0, 0.05))) * (k + 1)
            if name == "lr":
                v = 1e-3 * (50.0 if 150 <= t < 160 else 1.0)  # an LR fault
            elif r < 0.1:
                v = float(rng.choice([np.nan, np.inf, -np.inf]))
            elif r < 0.13:
                v *= 40.0                      # a spike
            m[name] = v
        if t % 10 == 0:
            m["val_loss"] = 1.1 + 0.01 * t / 10
        if t >= 100:
            m["grad_norm/late"] = float(np.exp(rng.normal(0.0, 0.1)))  # a keyed layer, late
        fams = {}
        for f in FAMS:
            if rng.random() < 0.1:
                continue
            a = np.exp(rng.normal(0.0, 0.05, n_layers))
            if f == "act_mean":
                a -= 1.0
            bad = rng.random(n_layers)
            a[bad < 0.02] = np.nan
            a[(bad >= 0.02) & (bad < 0.03)] = np.inf
            a[(bad >= 0.03) & (bad < 0.06)] *= 30.0
            fams[f] = a
        out.append((m, fams, n_layers))
    return out


def _declare(mon: Monitor, n_layers: int) -> None:
    for f in FAMS:
        mon.declare_family(f, [f"L{i}" for i in range(n_layers)])


def _banks(mon: Monitor) -> list[tuple]:
    return [(b.name, b.det.score.copy(), b.det.alarm.copy(), b.det._state.copy(),
             b.det._buf.copy()) for b in mon._bindings]


def _same_banks(a: list[tuple], b: list[tuple]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0]
        for u, v in zip(x[1:], y[1:], strict=True):
            np.testing.assert_array_equal(u, v, err_msg=x[0])


def _key(d) -> tuple:
    return (d.step, d.alarms, d.interventions, d.control.to_dict(), d.skipped)


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_equals_plain_path(seed: int) -> None:
    fused, plain = Monitor(CONFIG), PlainMonitor(CONFIG)
    n_alarms = 0
    layers = 0
    for t, (m, fams, n_layers) in enumerate(_stream(220, seed)):
        if n_layers != layers:
            layers = n_layers
            _declare(fused, n_layers)
            _declare(plain, n_layers)
        if t == 120:  # a snapshot round trip half way (through JSON) on the fused monitor
            sd = json.loads(json.dumps(fused.state_dict()))
            fused = Monitor(CONFIG)
            fused.load_state_dict(sd)
        if t == 180:
            fused.rewind(170)
            plain.rewind(170)
        step = t if t < 180 else t - 10
        df, dp = fused.observe(step, m, fams), plain.observe(step, m, fams)
        assert _key(df) == _key(dp), t
        assert fused._fused is not None and plain._fused is None
        _same_banks(_banks(fused), _banks(plain))
        n_alarms += len(df.alarms)
    assert n_alarms > 10  # the stream exercised the alarm path
    assert fused.counters == plain.counters
    sf, sp = fused.state_dict(), plain.state_dict()
    sf.pop("goodput"), sp.pop("goodput")
    assert json.dumps(sf, sort_keys=True) == json.dumps(sp, sort_keys=True)


def test_fused_step_equals_reference_step() -> None:
    """The driver alone: same inputs, outputs, states and alarm count as one call per bank."""
    rng = np.random.default_rng(3)
    mons = [Monitor(CONFIG), Monitor(CONFIG)]
    for mon in mons:
        _declare(mon, 6)
        mon.observe(0, {k: 1.0 for k in (*SCALARS, "val_loss")},
                    {f: np.ones(6) for f in FAMS})
    for t in range(200):
        vals = rng.normal(1.0, 0.3, mons[0]._vals.shape)
        vals[rng.random(vals.shape) < 0.05] = np.nan
        vals[t % 9 == 0] = 1e3  # spikes: alarms to count
        present = rng.random(vals.shape) < 0.85
        for mon in mons:
            mon._vals[:] = vals
            mon._present[:] = present
        a, b = mons
        n_fused = fused_step(*a._fused.args)
        n_ref = reference_step(b._vals, b._present, b._gather, b._calls, b._tslots, b._tracked)
        assert n_fused == n_ref
        np.testing.assert_array_equal(a._tracked, b._tracked)
        np.testing.assert_array_equal(a._tracked[:4][a._tracked[4:] == 1.0],
                                      vals[a._tslots][present[a._tslots]])
        for u, v in zip(a._gather, b._gather, strict=True):
            np.testing.assert_array_equal(u, v)
        _same_banks(_banks(a), _banks(b))
        assert not a._present.any()


def test_every_registered_kernel_is_fused() -> None:
    from stability.config.registry import REGISTRY

    mon = Monitor(CONFIG)
    _declare(mon, 2)
    mon.observe(0, {k: 1.0 for k in (*SCALARS, "val_loss", "update_ratio/L0")},
                {f: np.ones(2) for f in FAMS})
    assert {b.spec.detector for b in mon._bindings} == set(REGISTRY)
    assert mon._fused is not None
    assert (mon._fused.bufs.table[:, 0] != 0).all()


def test_fused_path_off_without_jit() -> None:
    """Where a kernel is not a Numba dispatcher (``NUMBA_DISABLE_JIT=1``) there is no plan."""
    from stability.monitor.fused import kernel_address

    assert kernel_address(lambda *a: None) == 0

    @njit
    def other(x):  # another signature: no entry point, the plain path calls it
        return x + 1

    assert kernel_address(other) == 0

    @njit
    def returns(x, m, st, buf, p, sc, al):  # the right arguments, but it returns a value
        return sc.shape[1]

    assert kernel_address(returns) == 0
    mon = Monitor(CONFIG)
    mon.observe(0, {"loss": 1.0})
    assert all(kernel_address(type(b.det).kernel) for b in mon._bindings)


def test_plan_refuses_non_contiguous_state() -> None:
    mon = Monitor(CONFIG)
    mon.observe(0, {"loss": 1.0})
    det = mon._bindings[1].det
    det._state = np.asfortranarray(np.zeros((det._state.shape[0], 3)))[:, ::2]
    bs = mon._bindings
    args = (mon._fused.bufs, [b.det for b in bs], [b.n_inputs for b in bs],
            [len(b.keys) for b in bs])
    assert build_fused_plan(*args, mon._vals, mon._present) is None


def test_plan_refuses_other_slot_vectors() -> None:
    """The driver reads the slot vector and mask through raw addresses: only float64 / bool
    C-contiguous writeable vectors of one size are accepted."""
    mon = Monitor(CONFIG)
    mon.observe(0, {"loss": 1.0})
    bs = mon._bindings
    args = (mon._fused.bufs, [b.det for b in bs], [b.n_inputs for b in bs],
            [len(b.keys) for b in bs])
    vals, present = mon._vals, mon._present
    assert build_fused_plan(*args, vals, present) is not None
    for v, p in ((vals.astype(np.float32), present), (vals, present.astype(np.uint8)),
                 (vals[::2], present[::2]), (vals, present[:-1]),
                 (np.repeat(vals, 2)[::2], present)):
        assert build_fused_plan(*args, v, p) is None


@pytest.mark.parametrize("seed", range(6))
def test_gather_runs_equals_gather_step(seed: int) -> None:
    """The run-aware gather of the fused step: consecutive slots copied by plain loops, the
    others one by one; idle bindings cleared; the same effect as gather_step."""
    rng = np.random.default_rng(seed)
    n_slots = 60
    sizes = rng.integers(0, 12, 7)
    boff = np.concatenate([[0], np.cumsum(sizes)])
    counts = np.maximum(sizes // 2, 1) * (sizes > 0)
    soff = np.concatenate([[0], np.cumsum(counts)])
    gidx = np.empty(boff[-1], dtype=np.int64)
    runs = np.full(len(sizes), -1, dtype=np.int64)
    for b, n in enumerate(sizes):
        lo = boff[b]
        if n and b % 2 == 0:  # a run of consecutive slots
            runs[b] = int(rng.integers(0, n_slots - n))
            gidx[lo:lo + n] = np.arange(runs[b], runs[b] + n)
        else:
            gidx[lo:lo + n] = rng.integers(0, n_slots, n)
    vals = rng.normal(size=n_slots)
    present = rng.random(n_slots) < 0.6
    present[gidx[boff[2]:boff[3]]] = False  # binding 2 idle
    outs = []
    for run, extra in ((gather_step, ()), (gather_runs, (runs,)),
                       (interpreted(gather_runs), (runs,))):
        args = [vals.copy(), present.copy(), gidx, boff, soff, np.zeros(boff[-1]),
                np.zeros(boff[-1], dtype=np.bool_), np.ones(soff[-1]),
                np.ones(soff[-1], dtype=np.bool_), np.zeros(len(sizes), dtype=np.bool_)]
        run(*args, *extra)
        outs.append(args)
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    assert not outs[0][1].any()  # present cleared
    if sizes[2]:
        assert not outs[0][9][2] and np.isnan(outs[0][7][soff[2]:soff[3]]).all()


def test_log_groups_share_one_log_row() -> None:
    """Banks reading the same values and their logs get one shared log row: the per-layer grad
    norms (EWMA + coherent jump) and the global one (two EWMAs); no other bank (tail_z's
    grad_explosion banks compute their own logs)."""
    mon = Monitor(CONFIG)
    _declare(mon, 3)
    mon.observe(0, {k: 1.0 for k in (*SCALARS, "val_loss")}, {f: np.ones(3) for f in FAMS})
    bufs = mon._fused.bufs
    names = [b.name for b in mon._bindings]
    groups = [sorted(names[b] for b in np.flatnonzero(bufs.table[:, 10] == row[1]))
              for row in bufs.groups[:bufs.ints[3]]]
    assert sorted(groups) == [["gn_ewma", "grad_vanishing"],
                              ["gn_layers_ewma", "grad_burst_layers"]]


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_equals_plain_path_wide(seed: int) -> None:
    """40 layers (the kernels' vectorised paths, reading the shared log row) with zeros,
    negative, tiny, subnormal, NaN and +-inf values and holes in the grad norms."""
    rng = np.random.default_rng(seed)
    n = 40
    edges = np.array([0.0, -1.0, 1e-30, 1e-31, 1e-300, 5e-324, np.nan, np.inf, -np.inf, 1e300])
    fused, plain = Monitor(CONFIG), PlainMonitor(CONFIG)
    for mon in (fused, plain):
        _declare(mon, n)
    n_alarms = 0
    for t in range(160):
        m = {"loss": float(np.exp(rng.normal(0.0, 0.05))), "lr": 1e-3,
             "grad_norm": float(np.exp(rng.normal(0.0, 0.1)))}
        g = np.exp(rng.normal(0.0, 0.1, n))
        hit = rng.random(n) < 0.05
        g[hit] = edges[rng.integers(0, edges.size, int(hit.sum()))]
        if t in (90, 130):
            g[: n // 2] *= 50.0  # a coherent jump
        fams = {f: (g if f == "grad_norm" else np.exp(rng.normal(0.0, 0.05, n)))
                for f in FAMS if not (f == "grad_norm" and t % 17 == 5)}
        df, dp = fused.observe(t, m, fams), plain.observe(t, m, fams)
        assert _key(df) == _key(dp), t
        _same_banks(_banks(fused), _banks(plain))
        n_alarms += len(df.alarms)
    assert fused._fused is not None and fused._fused.bufs.ints[3] == 2
    assert n_alarms > 3
