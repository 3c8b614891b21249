"""How far a fault moves each logged signal away from its clean counterfactual (issue 14).

Every faulted run of ``benchmarks/data/bench14`` is bit-identical to its configuration's clean
run before the onset, so ``log(faulted / clean)`` after the onset is the fault's own effect on a
signal.  For each faulted run of the chosen classes this prints the signals moved most in the
first ``--steps`` steps after the onset, next to the signal's natural step-to-step change (median
``|dlog x|`` of the clean run over the 40 steps before the onset).  A fault whose largest effect
is far below the natural change of every signal cannot be told from noise by any detector on
these signals.

Usage::

    python benchmarks/signal_effects.py --scenarios bit_flip,activation_spike --half even
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def effects(run: dict[str, np.ndarray], clean: dict[str, np.ndarray], onset: int,
            steps: int) -> list[tuple[float, str, float]]:
    """``(max |log(run / clean)| after onset, signal, natural |dlog x|)``, largest first."""
    n = min(len(run["step"]), len(clean["step"]))
    s = run["step"][:n]
    out = []
    for name, a in run.items():
        if name == "step" or name not in clean:
            continue
        a, b = a[:n], clean[name][:n]
        w = (s >= onset) & (s < onset + steps) & ~np.isnan(a) & ~np.isnan(b)
        if not w.any():
            continue
        with np.errstate(all="ignore"):
            d = np.abs(np.log(np.abs(a[w]) + 1e-30) - np.log(np.abs(b[w]) + 1e-30))
            pre = np.log(np.abs(b[(s >= onset - 40) & (s < onset)]) + 1e-30)
        pre = pre[np.isfinite(pre)]
        nat = float(np.median(np.abs(np.diff(pre)))) if pre.size > 3 else float("nan")
        out.append((float(np.nan_to_num(d, nan=np.inf).max()), name, nat))
    return sorted(out, key=lambda r: -r[0])


def main(argv: list[str] | None = None) -> int:
    import pyarrow.parquet as pq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(HERE / "data" / "bench14"))
    p.add_argument("--scenarios", default="bit_flip,activation_spike")
    p.add_argument("--half", choices=("even", "odd", "all"), default="even",
                   help="even configurations = the tuning half, odd = held out")
    p.add_argument("--steps", type=int, default=10, help="steps after the onset to look at")
    p.add_argument("--top", type=int, default=3)
    a = p.parse_args(argv)
    root = Path(a.data)
    labels = pq.read_table(root / "labels.parquet").to_pylist()
    clean = {r["config"]: r["run_id"] for r in labels if r["scenario"] == "clean"}

    def read(rid: str) -> dict[str, np.ndarray]:
        t = pq.read_table(root / "runs" / f"{rid}.parquet")
        return {c: t.column(c).to_numpy(zero_copy_only=False).astype(float)
                for c in t.column_names}

    wanted = set(a.scenarios.split(","))
    for r in labels:
        if r["scenario"] not in wanted or r["config"] not in clean:
            continue
        if a.half != "all" and (r["config"] % 2 == 0) != (a.half == "even"):
            continue
        eff = effects(read(r["run_id"]), read(clean[r["config"]]), int(r["onset_step"]),
                      a.steps)
        top = "; ".join(f"{n} {e:.3g} (natural {nat:.2g})" for e, n, nat in eff[:a.top])
        print(f"{r['run_id']} {r['scenario']} {r['model']} {r['optimizer']} {r['severity']}: "
              f"{top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
