"""Cold start: the first ``Monitor.observe()`` of a fresh process, empty and warm Numba cache.

Each figure is a fresh ``python`` process running the default preset with the metrics a torch
guard sends on its first step (loss, lr, grad_norm, param_norm, per-layer grad_norm and
update_ratio families).  It reports

* ``first observe`` -- the first ``observe()`` call (import and ``Monitor()`` are separate);
* ``to compiled``   -- from the first ``observe()`` until every kernel it used runs machine
  code (steps keep being observed every ``--step-ms`` meanwhile, as a training loop would);
* ``steps``         -- how many steps were observed with interpreted kernels meanwhile, and
  their median ``observe()`` time (``obs ms``);
* ``step ms``       -- the median time of the simulated training step's host work (pure
  Python, ``--step-ms`` long on an idle process) before the monitor exists, while the kernels
  compile, and after: what compiling aside costs the training loop (a thread competes for
  the GIL; the niced child only for the CPU); ``slowdown`` is the middle one over the mean of
  the other two.

``empty``: ``NUMBA_CACHE_DIR`` is a fresh ``mktemp -d`` (nothing compiled, the cold start a
fresh container, a read-only site-packages or a new rank sees); ``warm``: the same directory
again, once filled.  Each is repeated ``--repeat`` times (a new empty directory each time) and
the median printed next to its target (<= 3 s cold, <= 0.5 s warm, issue 17).  Modes are the
values of ``STABILITY_COLD_START`` (``detectors.dispatch.py``): ``subprocess`` (default),
``thread``, and ``blocking`` (compile on the first call: the behaviour before the twin).

    python benchmarks/bench_coldstart.py [--repeat 3] [--modes subprocess,thread,blocking]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_COLD_S = 3.0
TARGET_WARM_S = 0.5

_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from stability.monitor.monitor import Monitor
from detectors import dispatch
t1 = time.perf_counter()


def work(n):  # a training step's host work: pure Python, holds the GIL
    x = 0
    for i in range(n):
        x += i * i
    return x


def timed(n):
    ta = time.perf_counter()
    work(n)
    return time.perf_counter() - ta


n = 20000
while True:  # calibrate n to --step-ms (best of 5: the box may be busy)
    dt = min(timed(n) for _ in range(5))
    if dt > 0.002:
        break
    n *= 2
n = max(1, int(n * float(sys.argv[1]) / 1000.0 / dt))
base = []
for _ in range(20):
    ta = time.perf_counter()
    work(n)
    base.append(time.perf_counter() - ta)
t1b = time.perf_counter()
mon = Monitor("default")
for fam in ("grad_norm", "update_ratio"):
    mon.declare_family(fam, [f"layer{i}" for i in range(8)])
t2 = time.perf_counter()
rng = np.random.default_rng(0)
obs, steps = [], []
s = 0
first = None
while True:
    m = {"loss": 2.0 + 0.01 * rng.normal(), "lr": 1e-3, "grad_norm": 1.0 + 0.1 * rng.random(),
         "param_norm": 10.0}
    f = {"grad_norm": 1.0 + 0.1 * rng.random(8), "update_ratio": 1e-3 * (1 + rng.random(8))}
    ta = time.perf_counter()
    mon.observe(s, m, families=f)
    tb = time.perf_counter()
    if first is None:
        first = tb - ta
    elif not dispatch.pending():
        break
    else:
        obs.append(tb - ta)
    s += 1
    if s > 100000:
        break
    tc = time.perf_counter()
    work(n)
    steps.append(time.perf_counter() - tc)
t3 = time.perf_counter()
after = []
for _ in range(20):
    ta = time.perf_counter()
    work(n)
    after.append(time.perf_counter() - ta)


def med(v):
    return sorted(v)[len(v) // 2] if v else 0.0


print(json.dumps({"import": t1 - t0, "build": t2 - t1b, "first_observe": first,
                  "to_compiled": t3 - t2, "steps": s, "median_observe_ms": 1e3 * med(obs),
                  "step_ms_before": 1e3 * med(base), "step_ms_meanwhile": 1e3 * med(steps),
                  "step_ms_after": 1e3 * med(after)}))
"""


def run_once(cache_dir: str, mode: str, step_ms: float) -> dict[str, Any]:
    """One fresh process with ``NUMBA_CACHE_DIR=cache_dir`` and ``STABILITY_COLD_START=mode``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT),
           "STABILITY_COLD_START": mode}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(step_ms)], env=env, cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def bench_mode(mode: str, repeat: int, step_ms: float) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` pairs (empty cache, then the same cache warm) in fresh directories."""
    res: dict[str, list[dict[str, Any]]] = {"empty": [], "warm": []}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="numba-cold-") as d:
            res["empty"].append(run_once(d, mode, step_ms))
            res["warm"].append(run_once(d, mode, step_ms))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="subprocess,thread,blocking")
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="pure-Python work between observed steps (a training step's host "
                         "work, holding the GIL)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    a = ap.parse_args(argv)
    print(f"python {' '.join(sys.argv)}   (median of {a.repeat}, load {os.getloadavg()[0]:.2f})")
    print(f"{'mode':<11}{'cache':<7}{'first observe':>15}{'target':>9}{'to compiled':>13}"
          f"{'steps':>7}{'obs ms':>9}{'step ms before/meanwhile/after':>32}{'slowdown':>10}")
    raw: dict[str, Any] = {}
    for mode in a.modes.split(","):
        raw[mode] = r = bench_mode(mode, a.repeat, a.step_ms)
        for cache, target in (("empty", TARGET_COLD_S), ("warm", TARGET_WARM_S)):
            rows = r[cache]
            first = statistics.median(x["first_observe"] for x in rows)
            comp = statistics.median(x["to_compiled"] for x in rows)
            steps = statistics.median(x["steps"] for x in rows)
            obs = statistics.median(x["median_observe_ms"] for x in rows)
            st = "/".join(f"{statistics.median(x['step_ms_' + k] for x in rows):.1f}"
                          for k in ("before", "meanwhile", "after"))
            slow = statistics.median(
                2.0 * x["step_ms_meanwhile"] / (x["step_ms_before"] + x["step_ms_after"])
                for x in rows if x["steps"] > 1) if any(x["steps"] > 1 for x in rows) else 1.0
            ok = "ok" if first <= target else "MISS"
            print(f"{mode:<11}{cache:<7}{first:>13.3f} s{'<= ' + str(target):>8} {ok:<4}"
                  f"{comp:>9.2f} s{steps:>7.0f}{obs:>9.2f}{st:>32}{slow:>9.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
