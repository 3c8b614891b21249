"""Microseconds per ``Monitor.observe()`` for a realistic LLM configuration.

~20 scalar signals + 128 layers x 4 activation statistics + 128 per-layer gradient norms, with the
``llm_pretrain`` preset (13 detector bindings, policy included):

(a) per-layer families passed as arrays (``declare_family`` fast path);
(b) the same values as ~660 separate keys.

Run::

    python benchmarks/bench_monitor.py [--steps 20000] [--layers 128] [--breakdown] [--cold]
                                       [--cpu] [--families-only] [--bound]

``--breakdown`` also times the parts of one step separately (private monitor internals; the
figures are best-of-repeats, so they do not add up exactly on a loaded machine): the fills, the
fused step (gather + every bank + alarm count in one Numba call, :mod:`stability.monitor.fused`;
split into gather / shared log rows / call overhead and the banks' arithmetic, then each bank
alone), the policy's per-step tracking, the decision and goodput bookkeeping, and for
comparison the plain path it replaces.
``--cpu`` times the blocks in process CPU time instead of wall time (on a shared, loaded machine:
compare two checkouts by running them alternately and taking medians); ``--families-only``
skips (b).
``--bound`` times (c) only: ``Monitor.observe_bound()`` on inputs bound once with
``bind_inputs`` (the caller writes each step's values into the monitor's own buffers) next to
``observe()`` fed the same stream, in alternating blocks (same decisions asserted).
``--cold`` times the first ``observe()`` in a fresh process with an empty ``NUMBA_CACHE_DIR``
(every kernel and the fused driver compiled) and again with that cache filled (wall and CPU
seconds: on a loaded machine the CPU figure is the one to compare).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from stability import Monitor

STATS = ("act_mean", "act_std", "act_absmax", "act_kurtosis")
SCALARS = ("loss", "lr", "grad_norm", "update_ratio", "param_norm", "tokens_per_s", "mfu",
           "loss_scale", "batch_size", "seq_len", "throughput", "mem_gb", "step_time",
           "data_time", "z_loss", "aux_loss", "moe_balance", "clip_frac", "wd", "epoch")


def make_stream(steps: int, layers: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(scalars (steps, 20), per-layer (steps, 5, layers)) of stationary log-normal noise."""
    rng = np.random.default_rng(seed)
    sc = np.exp(rng.normal(0.0, 0.03, (steps, len(SCALARS))))
    sc[:, 1] = 3e-4  # constant LR
    fam = np.exp(rng.normal(0.0, 0.03, (steps, len(STATS) + 1, layers)))
    fam[:, 0] -= 1.0  # act_mean around 0
    return sc, fam


def bench_bound(steps: int, layers: int, preset: str, cpu: bool = False) -> tuple[float, float]:
    """Median-block µs/step of ``observe_bound`` (bound inputs) next to ``observe()`` with the
    same stream (families as arrays), in alternating blocks; the bound loop includes the
    caller's writes into the views (one NumPy copy for the scalar row, one for the families'
    ``(5, layers)`` matrix, the ``val_loss`` presence flag), which are also timed alone."""
    names = [f"L{i}" for i in range(layers)]
    sc, fam = make_stream(steps, layers)
    fams = (*STATS, "grad_norm")
    ref, mon = Monitor(preset), Monitor(preset)
    keys = [*SCALARS, "val_loss"]
    inp = mon.bind_inputs(keys, families={f: names for f in fams})
    assert inp.zero_copy
    for f in fams:
        ref.declare_family(f, names)
    rows = np.concatenate([sc, sc[:, :1]], axis=1)  # + val_loss (= loss where logged)
    inputs = []
    for t in range(steps):
        d = dict(zip(SCALARS, sc[t].tolist(), strict=True))
        if t % 50 == 0:
            d["val_loss"] = float(sc[t, 0])
        inputs.append((d, {f: fam[t, k] for k, f in enumerate(fams)}))
    vals, present, matrix = inp.values, inp.present, inp.family_matrix
    assert matrix is not None  # the five families, one row each
    iv = inp.index("val_loss")

    def run_bound(lo: int, hi: int, observe: bool = True) -> None:
        obs = mon.observe_bound
        for t in range(lo, hi):
            vals[:] = rows[t]
            present[iv] = t % 50 == 0
            matrix[:] = fam[t]
            if observe:
                obs(t)

    def run_ref(lo: int, hi: int, _: bool = True) -> None:
        obs = ref.observe
        for t in range(lo, hi):
            m, f = inputs[t]
            obs(t, m, f)

    warm = min(200, steps // 4)
    run_bound(0, warm)
    run_ref(0, warm)
    block = 250
    per: list[list[float]] = [[], [], []]
    clock = time.process_time if cpu else time.perf_counter
    for lo in range(warm, steps - block + 1, block):
        for k, (fn, obs) in enumerate(((run_ref, True), (run_bound, True), (run_bound, False))):
            t0 = clock()
            fn(lo, lo + block, obs)
            per[k].append(1e6 * (clock() - t0) / block)
    assert mon.counters == ref.counters, (mon.counters, ref.counters)  # same decisions
    med = [float(np.median(p)) for p in per]
    best = [min(p) for p in per]
    print(f"  observe():       median block {med[0]:7.2f} us/step, best {best[0]:7.2f}")
    print(f"  observe_bound(): median block {med[1]:7.2f} us/step, best {best[1]:7.2f} "
          f"(incl. the caller's writes into the views: {med[2]:.2f} median, "
          f"{best[2]:.2f} best)")
    print(f"  observe_bound() alone (bound minus writes): median {med[1] - med[2]:7.2f} "
          f"us/step; {mon.counters['alarms']} alarms, same counters as observe()")
    return med[1], med[0]


def _best_us(fn: object, number: int = 200, repeat: int = 60) -> float:
    """Best of many short runs: robust to a loaded machine."""
    return 1e6 * min(timeit.repeat(fn, number=number, repeat=repeat)) / number  # type: ignore[arg-type]


def breakdown(mon: Monitor, step: int, metrics: dict, families: dict | None) -> None:
    """Print the cost of each part of ``observe()`` (uses the monitor's private internals)."""
    from stability.monitor.fused import fused_step, reference_step

    sk: list[str] = []
    parts = {"fill metrics": _best_us(lambda: mon._fill(metrics, sk))}
    if families:
        parts["fill families"] = _best_us(lambda: mon._fill_families(families, sk))
    g, fp = mon._gather, mon._fused
    assert fp is not None, "the fused driver is not in use"
    mon._fill(metrics, sk)
    if families:
        mon._fill_families(families, sk)
    present = mon._present.copy()  # this step's presence pattern (the step clears it)
    (ints,) = fp.args
    no_banks = ints.copy()  # the bank table with zero series everywhere: every bank skipped
    table = fp.bufs.table   # a view into ints
    at = (table.ctypes.data - ints.ctypes.data) // ints.itemsize
    no_banks[at:at + table.size].reshape(table.shape)[:, 2] = 0

    def restore() -> None:
        mon._present[:] = present

    def step_with(table_ints: np.ndarray) -> None:
        mon._present[:] = present
        fused_step(table_ints)

    def plain() -> None:
        mon._present[:] = present
        reference_step(mon._vals, mon._present, g, mon._calls, mon._tslots, mon._tracked)

    base = _best_us(restore)
    fused = _best_us(lambda: step_with(ints)) - base
    gather = _best_us(lambda: step_with(no_banks)) - base
    parts["fused step (1 njit call)"] = fused
    # what observe() does with a step's LR and loss: the inlined quiet tracking when it applies
    parts["policy tracking"] = _best_us(lambda: mon.policy.track_quiet(step, 3e-4, 1.0)
                                        or mon._track_values(step, 3e-4, 1.0, None))
    parts["decision + goodput"] = _best_us(lambda: mon._finish_step(step, None, 1.0, (), ()))
    box = [step]

    def obs() -> None:
        box[0] += 1
        mon.observe(box[0], metrics, families)

    total = _best_us(obs)
    for k, v in parts.items():
        print(f"      {k:30s} {v:7.2f} us")
        if k.startswith("fused"):
            print(f"        {'gather + log rows + call':28s} {gather:7.2f} us")
            print(f"        {'bank kernels (arithmetic)':28s} {fused - gather:7.2f} us")
    print(f"      {'rest (python glue)':30s} {total - sum(parts.values()):7.2f} us")
    print("      bank kernels one at a time (fused step with only that bank, minus none):")
    ns_col = no_banks[at:at + table.size].reshape(table.shape)[:, 2]
    for b, binding in enumerate(mon._bindings):
        if table[b, 2] == 0:
            continue
        one = no_banks.copy()
        one[at:at + table.size].reshape(table.shape)[b, 2] = table[b, 2]
        assert ns_col[b] == 0
        us = _best_us(lambda one=one: step_with(one)) - base - gather
        print(f"        {binding.spec.name:24s} {type(binding.det).__name__:19s} "
              f"{int(table[b, 2]):4d} series {us:6.2f} us")
    print(f"      {'observe() total':30s} {total:7.2f} us")
    print(f"      {'plain path: gather + 1 call/bank':30s} {_best_us(plain) - base:7.2f} us "
          f"({int(g.active.sum())} active banks; replaced by the fused step)")


class PlainMonitor(Monitor):
    """The monitor on its plain path (gather + one call per bank), for comparison."""

    def _relayout(self) -> None:
        super()._relayout()
        self._fused = None


def bench(steps: int, layers: int, keyed: bool, preset: str, parts: bool = False,
          cpu: bool = False) -> tuple[float, float]:
    """Best-block µs/step of the monitor and of the plain path, fed the same stream in
    alternating blocks (same load for both)."""
    names = [f"L{i}" for i in range(layers)]
    sc, fam = make_stream(steps, layers)
    mons = [Monitor(preset), PlainMonitor(preset)]
    fams = (*STATS, "grad_norm")
    if not keyed:
        for mon in mons:
            for f in fams:
                mon.declare_family(f, names)
    keys = [[f"{f}/{n}" for n in names] for f in fams]
    inputs = []
    for t in range(steps):
        d = dict(zip(SCALARS, sc[t].tolist(), strict=True))
        if t % 50 == 0:
            d["val_loss"] = float(sc[t, 0])
        if keyed:
            for k in range(len(fams)):
                d.update(zip(keys[k], fam[t, k].tolist(), strict=True))
            inputs.append((d, None))
        else:
            inputs.append((d, {f: fam[t, k] for k, f in enumerate(fams)}))
    warm = min(200, steps // 4)
    for mon in mons:
        for t in range(warm):
            mon.observe(t, *inputs[t])
    block = 250
    per_block: list[list[float]] = [[], []]
    clock = time.process_time if cpu else time.perf_counter
    for lo in range(warm, steps - block + 1, block):
        for k, mon in enumerate(mons):
            obs = mon.observe
            t0 = clock()
            for t in range(lo, lo + block):
                m, f = inputs[t]
                obs(t, m, f)
            per_block[k].append(1e6 * (clock() - t0) / block)
    mon = mons[0]
    assert mon.counters == mons[1].counters  # same decisions
    best, med = min(per_block[0]), float(np.median(per_block[0]))
    plain = min(per_block[1])
    alarms = mon.counters["alarms"]
    n_keys = len(inputs[-1][0])
    print(f"  {'keys' if keyed else 'families':8s}: best block {best:7.2f} us/step, median "
          f"{med:7.2f} ({n_keys} keys per step, {len(mon.signals)} signals, {alarms} alarms); "
          f"plain path {plain:7.2f}")
    if parts:
        breakdown(mon, steps, *inputs[warm])
    return best, plain


_FIRST_OBSERVE = """
import sys, time
import numpy as np
from stability import Monitor
mon = Monitor(sys.argv[1])
names = [f"L{i}" for i in range(int(sys.argv[2]))]
fams = ("act_mean", "act_std", "act_absmax", "act_kurtosis", "grad_norm")
for f in fams:
    mon.declare_family(f, names)
m = {"loss": 2.0, "lr": 3e-4, "grad_norm": 1.0, "param_norm": 10.0, "val_loss": 2.1}
w, c = time.perf_counter(), time.process_time()
mon.observe(0, m, {f: np.ones(len(names)) for f in fams})
print(time.perf_counter() - w, time.process_time() - c)
"""


def cold_start(preset: str, layers: int) -> None:
    """First ``observe()`` in a fresh process with an empty Numba cache, then with it filled."""
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        for label, target in (("empty cache", 3.0), ("warm cache", 0.5)):
            out = subprocess.run([sys.executable, "-c", _FIRST_OBSERVE, preset, str(layers)],
                                 env=env, capture_output=True, text=True, check=True)
            wall, cpu = map(float, out.stdout.split()[-2:])
            print(f"first observe(), {label:11s}: {wall:6.2f} s wall, {cpu:6.2f} s CPU "
                  f"(target <= {target} s)")


def main() -> None:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady-state figures (cold start: bench_coldstart.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--preset", default="llm_pretrain")
    ap.add_argument("--breakdown", action="store_true", help="time the parts of one step")
    ap.add_argument("--cold", action="store_true",
                    help="also time the first observe() with an empty, then a warm Numba cache")
    ap.add_argument("--cpu", action="store_true", help="time blocks in process CPU time")
    ap.add_argument("--families-only", action="store_true", help="skip (b), separate keys")
    ap.add_argument("--bound", action="store_true",
                    help="only (c): observe_bound() with bound inputs next to observe()")
    a = ap.parse_args()
    if a.bound:
        print(f"Monitor.observe_bound() vs observe(), preset {a.preset!r}, {len(SCALARS)} "
              f"scalars + val_loss + {a.layers} layers x ({len(STATS)} act stats + grad_norm), "
              f"{a.steps} steps, {'CPU' if a.cpu else 'wall'} time")
        b, o = bench_bound(a.steps, a.layers, a.preset, a.cpu)
        print(f"(c) bound inputs: {b:.2f} us/step (median block, incl. writes; target <= 10; "
              f"observe() {o:.2f})")
        return
    print(f"Monitor.observe(), preset {a.preset!r}, {len(SCALARS)} scalars + {a.layers} layers x "
          f"({len(STATS)} act stats + grad_norm), {a.steps} steps, policy included")
    fa, pa = bench(a.steps, a.layers, keyed=False, preset=a.preset, parts=a.breakdown,
                   cpu=a.cpu)
    print(f"(a) families as arrays: {fa:.2f} us/step (best block; target <= 10; plain path "
          f"{pa:.2f})")
    if not a.families_only:
        fb, pb = bench(a.steps, a.layers, keyed=True, preset=a.preset, parts=a.breakdown,
                       cpu=a.cpu)
        print(f"(b) separate keys:      {fb:.2f} us/step (best block; target <= 100; plain "
              f"path {pb:.2f})")
    if a.cold:
        cold_start(a.preset, a.layers)


if __name__ == "__main__":
    main()
