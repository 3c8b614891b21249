"""Cold start: interpreted twins decide exactly as the compiled kernels (detectors/dispatch.py).

A monitor whose kernels are not compiled yet runs their plain-Python twins and switches to
machine code when the background compiler is done, at any step.  That is only sound if both
forms give bit-identical scores, alarms *and* state on every input: checked here on random
streams with missing, non-finite, zero, negative, huge and offset values for every registered
detector (several hyperparameter settings), on the monitor's gather kernel, and by replaying
shared public runs through the twins against the golden decisions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from numba import njit

from detectors import dispatch
from detectors.dispatch import call, interpreted, kernel_ready
from stability.config.registry import REGISTRY, detector_class
from stability.monitor.binding import gather_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(bool(numba.config.DISABLE_JIT),
                                reason="no compiled kernels to compare the twins with")

#: hyperparameter settings besides the defaults (a setting a class rejects is skipped)
VARIANTS: list[dict[str, Any]] = [
    {},
    {"freeze_on_alarm": True},
    {"log_space": False},
    {"direction": "up"},
    {"direction": "down"},
    {"threshold": 1.0},
    {"warmup": 2},
    {"window": 8},
]


def _bits(a: np.ndarray) -> np.ndarray:
    """Exact bit pattern, every NaN the same (payloads are not part of a decision)."""
    a = np.asarray(a)
    if a.dtype != np.float64:
        return a
    b = a.view(np.int64).copy()
    b[np.isnan(a)] = 0x7FF8000000000000
    return b


def _stream(rng: np.random.Generator, t: int, n_in: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.exp(rng.normal(0.0, 1.0, (t, n_in, n))) * rng.choice([1e-3, 1.0, 1e3], (1, n_in, n))
    x[rng.random(x.shape) < 0.03] *= 100.0  # spikes
    x[:, :, -1] += 1e8  # large offset
    for value, p in ((np.nan, 0.01), (np.inf, 0.005), (-np.inf, 0.005), (0.0, 0.01),
                     (-1.0, 0.01), (1e300, 0.002), (-1e300, 0.002), (5e-324, 0.002)):
        x[rng.random(x.shape) < p] = value
    x[t // 2: t // 2 + 20, :, 0] = 3.0  # a constant stretch
    miss = rng.random(x.shape) < 0.05
    return np.ascontiguousarray(x), miss


def _detectors() -> list[tuple[str, int]]:
    return [(name, v) for name in REGISTRY for v in range(len(VARIANTS))]


@pytest.mark.parametrize(("name", "variant"), _detectors())
def test_interpreted_kernel_is_bit_identical(name: str, variant: int) -> None:
    cls = detector_class(name)
    try:
        det = cls(n_series=4, **VARIANTS[variant])
    except (TypeError, ValueError):
        pytest.skip(f"{cls.__name__} has no setting {VARIANTS[variant]}")
    rng = np.random.default_rng(variant)
    t = 700
    x, miss = _stream(rng, t, det.n_inputs, 4)
    twin = interpreted(cls.kernel)
    assert twin is not cls.kernel and not hasattr(twin, "signatures")
    outs = []
    for run in (cls.kernel, twin):
        state, buf = det._state.copy(), det._buf.copy()
        scores, alarms = np.empty((t, 4)), np.empty((t, 4), dtype=np.bool_)
        with np.errstate(all="ignore"):
            run(x, miss, state, buf, det._params_arr, scores, alarms)
        outs.append((scores, alarms, state, buf))
    for what, a, b in zip(("scores", "alarms", "state", "buf"), *outs, strict=True):
        assert np.array_equal(_bits(a), _bits(b)), f"{name} {VARIANTS[variant]}: {what} differ"
    assert outs[0][1].any() and not outs[0][1].all()  # the stream exercised both outcomes


def test_switching_mid_stream_gives_the_compiled_decisions() -> None:
    """Twin for the first steps, compiled afterwards == compiled throughout (state carries)."""
    for name in ("ewma_z", "robust_z", "adwin", "activation_shift"):
        cls = detector_class(name)
        a, b = cls(n_series=3), cls(n_series=3)
        x, miss = _stream(np.random.default_rng(1), 300, a.n_inputs, 3)
        twin = interpreted(cls.kernel)
        for s in range(300):
            xs, ms = x[s: s + 1], miss[s: s + 1]
            a.update_array(xs, ms)
            with np.errstate(all="ignore"):
                (twin if s < 150 else cls.kernel)(xs, ms, b._state, b._buf, b._params_arr,
                                                  b._score1, b._alarm1)
            assert np.array_equal(_bits(a.score), _bits(b.score)), (name, s)
            assert np.array_equal(a.alarm, b.alarm), (name, s)
        assert np.array_equal(_bits(a._state), _bits(b._state))


def test_gather_kernel_twin_is_identical() -> None:
    rng = np.random.default_rng(3)
    n_slots, n_b = 12, 4
    boff = np.array([0, 3, 3, 7, 10])
    soff = np.array([0, 3, 3, 5, 8])
    gidx = rng.integers(0, n_slots, 10)
    vals = rng.normal(size=n_slots)
    present = rng.random(n_slots) < 0.5
    gidx[3:7], present[0], present[1] = 0, False, True  # binding 2 idle, binding 3 not
    gidx[7] = 1
    outs = []
    for run in (gather_step, interpreted(gather_step)):
        args = [vals.copy(), present.copy(), gidx, boff, soff, np.zeros(10),
                np.zeros(10, dtype=np.bool_), np.ones(8), np.ones(8, dtype=np.bool_),
                np.zeros(n_b, dtype=np.bool_)]
        run(*args)
        outs.append(args)
    for a, b in zip(*outs, strict=True):
        assert np.array_equal(_bits(a), _bits(b))
    assert not outs[0][1].any() and np.isnan(outs[0][7]).any()


# ------------------------------------------------------------------------------ golden runs
def _golden_runs() -> list[tuple[str, str]]:
    # the most alarms and a short run (shared), and a shipped run that runs on a fresh clone
    return [("public", "public_0018"), ("public", "public_0014"), ("public", "public_0009"),
            ("shipped", "bitflip")]


@pytest.mark.parametrize(("which", "run"), _golden_runs())
def test_runs_replay_to_the_golden_decisions_interpreted(
        which: str, run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.golden.make_golden import RUNS, decisions, load, run_name

    path = next((p for p in RUNS[which]() if run_name(p) == run), None)
    if path is None:
        assert which != "shipped", f"shipped run {run} missing"
        pytest.skip(f"shared public runs not found ({run}; set STABILITY_SHARED_DIR)")
    want = load(which)[f"default/{run}"]
    ran: set[str] = set()

    def counted(name: str, twin: Any) -> Any:
        def run(*args: Any) -> None:
            ran.add(name)
            twin(*args)
        return staticmethod(run)

    for name in REGISTRY:
        cls = detector_class(name)
        monkeypatch.setattr(cls, "kernel", counted(name, interpreted(cls.kernel)))
    with np.errstate(all="ignore"):
        got = json.loads(json.dumps(decisions(path, "default")))
    assert {"ewma_z", "robust_z", "nonfinite", "lr_jump"} <= ran  # the twins did the work
    assert got["alarms"] and got == want


# ------------------------------------------------------------------------------ dispatch
def _fresh_kernel() -> Any:
    """A kernel compiled by nobody yet (``cache=False``: only this process can build it)."""

    @njit(error_model="numpy")
    def k(x, out):  # type: ignore[no-untyped-def]
        for i in range(x.shape[0]):
            out[i] = math.sqrt(x[i]) + 1.0

    return k


def test_call_runs_the_twin_then_the_compiled_kernel() -> None:
    dispatch.set_mode("thread")
    try:
        k = _fresh_kernel()
        x = np.array([4.0, -1.0, np.inf])
        out = np.zeros(3)
        assert not kernel_ready(k)
        call(k, x, out)
        assert np.array_equal(_bits(out), _bits(np.array([3.0, np.nan, np.inf])))
        assert dispatch.wait_ready(timeout=600)
        assert kernel_ready(k) and len(k.signatures) == 1
        out2 = np.zeros(3)
        call(k, x, out2)
        assert np.array_equal(_bits(out), _bits(out2))
        assert dispatch.pending() == []
    finally:
        dispatch.set_mode(None)


def test_a_twin_that_raises_is_undone_and_the_compiled_kernel_runs() -> None:
    """``math.log(0.0)`` raises in Python and is ``-inf`` in Numba: no crash, no partial write."""

    @njit(error_model="numpy")
    def k(x, out):  # type: ignore[no-untyped-def]
        for i in range(x.shape[0]):
            out[i] += 1.0
            out[i] = math.log(x[i]) + out[i]

    dispatch.set_mode("thread")
    try:
        out = np.zeros(2)
        call(k, np.array([1.0, 0.0]), out)
        assert out[0] == 1.0 and out[1] == -np.inf
        assert kernel_ready(k)
    finally:
        dispatch.set_mode(None)


def test_blocking_mode_compiles_on_the_first_call() -> None:
    dispatch.set_mode("blocking")
    try:
        k = _fresh_kernel()
        out = np.zeros(1)
        call(k, np.array([9.0]), out)
        assert len(k.signatures) == 1 and kernel_ready(k) and out[0] == 4.0
    finally:
        dispatch.set_mode(None)


def test_a_described_signature_compiles_to_the_same_specialisation() -> None:
    """The child rebuilds the exact Numba types the parent's call has (arrays and scalars)."""
    from numba import typeof

    from detectors._warm import compile_job

    @njit(error_model="numpy")
    def k(x, flags, n, scale, on):  # type: ignore[no-untyped-def]
        for i in range(min(n, x.shape[0])):
            if on and flags[i]:
                x[i] *= scale

    args = (np.ones(3), np.ones((3,), dtype=np.bool_)[::1], np.int64(2), 2.0, True)
    sig = tuple(typeof(a) for a in args)
    desc = dispatch.describe(sig)
    assert desc is not None and json.loads(json.dumps(desc)) == desc
    fake = type(sys)("coldstart_fake")
    fake.k = k  # type: ignore[attr-defined]
    sys.modules["coldstart_fake"] = fake
    try:
        compile_job({"module": "coldstart_fake", "qualname": "k", "args": desc})
    finally:
        del sys.modules["coldstart_fake"]
    assert k.signatures == [sig]
    k(*args)  # no second specialisation
    assert len(k.signatures) == 1
    assert dispatch.describe((typeof((1, 2)),)) is None


def test_set_mode_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="must be one of"):
        dispatch.set_mode("eager")


_COLD = """
import json, sys
import numpy as np
from detectors import dispatch
from stability.monitor.monitor import Monitor
from stability.config.registry import detector_class
cfg = {"detectors": [{"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
                      "params": {"warmup": 2, "threshold": 3.0}}]}
kernel = detector_class("ewma_z").kernel
mon, ref = Monitor(cfg), []
first = None
for s in range(12):
    loss = 1.0 + 0.01 * s if s != 8 else 50.0
    d = mon.observe(s, {"loss": loss})
    ref.append([a.detector for a in d.alarms])
    if first is None:
        first = len(kernel.signatures)
fused_meanwhile = mon._fused is not None
ok = dispatch.wait_ready(timeout=900)
for s in range(12, 14):  # the first step after: still the plain path, which sees it is done
    mon.observe(s, {"loss": 1.1})
print(json.dumps({"first": first, "ok": ok, "after": len(kernel.signatures),
                  "fused": [fused_meanwhile, mon._fused is not None],
                  "cached": dispatch.cached(kernel, kernel.signatures[0]) if ok else None,
                  "alarms": ref, "pending": dispatch.pending()}))
"""


def test_an_empty_cache_is_filled_by_the_child_process(tmp_path: Path) -> None:
    """Fresh process, empty ``NUMBA_CACHE_DIR``: the first step compiles nothing here, the
    child fills the cache, this process loads from it, and the alarms are the usual ones."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path),
           "STABILITY_COLD_START": "subprocess"}
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run([sys.executable, "-c", _COLD], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1200, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["first"] == 0  # the first observe ran the twin
    assert got["ok"] and got["after"] == 1 and got["pending"] == []
    assert got["cached"] is True  # written by the child: the index lists it
    assert any(tmp_path.rglob("ewma._kernel-*.nbi"))
    assert got["fused"] == [False, True]  # the one-call driver once everything is compiled
    assert got["alarms"][8] == ["loss_spike"]
    assert not any(got["alarms"][:8])


def test_compiling_children_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two holders of the warm lock (two ranks' children) never compile at the same time."""
    import threading

    from detectors._warm import _one_at_a_time

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    pytest.importorskip("fcntl")
    entered = threading.Event()

    def second() -> None:
        with _one_at_a_time():
            entered.set()

    with _one_at_a_time():
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.5)  # blocked while the first holds the lock
    t.join(30)
    assert entered.is_set()
    assert (tmp_path / "stability-warm.lock").exists()


_REPLAY = r"""
import json, sys
from detectors import dispatch
from detectors._base import TWIN_MAX_VALUES
from replay.io import load_run
from stability import Monitor

if sys.argv[1] == "twins":
    dispatch.set_mode("subprocess")
    dispatch._request = lambda kernel, sig: None  # nothing ever compiles: twins throughout
else:
    dispatch.set_mode("blocking")
table = load_run("data/runs/lr_blowup")
mon = Monitor("default", alert_sinks=[])
ds = mon.replay(table)
kernel = type(mon.detector("loss_spike")).kernel
events = [[d.step, [[a.kind, a.signal, float(a.score).hex()] for a in d.alarms],
           [repr(iv) for iv in d.interventions]] for d in ds.events()]
state = json.dumps(mon.state_dict(), sort_keys=True, default=lambda a: a.tolist())
print(json.dumps({"events": events, "state": state, "compiled": bool(kernel.signatures),
                  "rows": table.num_rows, "twin_max": TWIN_MAX_VALUES}))
"""


def test_a_short_replay_on_a_cold_cache_runs_the_twins_with_the_same_decisions(
        tmp_path: Path) -> None:
    """``stability replay`` of a short run with an empty cache does not wait for LLVM: the batch
    kernels run interpreted (``TWIN_MAX_VALUES``) and decide bit for bit as compiled ones."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_DISABLE_JIT", None)
    got = {}
    for how in ("twins", "blocking"):
        out = subprocess.run([sys.executable, "-c", _REPLAY, how], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=1200, check=True).stdout
        got[how] = json.loads(out.strip().splitlines()[-1])
    assert got["twins"]["rows"] <= got["twins"]["twin_max"]  # the run is short enough
    assert not got["twins"]["compiled"] and got["blocking"]["compiled"]
    assert got["twins"]["events"] and got["twins"]["events"] == got["blocking"]["events"]
    assert got["twins"]["state"] == got["blocking"]["state"]
