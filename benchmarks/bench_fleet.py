"""Which rank is the culprit: attribution accuracy over many injected faults, on gloo CPU ranks.

Each run is one gloo process group (``--world`` ranks, a tiny MLP under DDP with the local
gradient-norm hook, ``ControlSync(ranks=True)``) training for a few hundred steps while a seeded
plan injects faults on one rank at a time, with clean steps between them: a NaN loss, a 5x
gradient scale (a bit-flip-like corruption of one replica's gradient) and a 5x slowdown (three
slow steps). A fault is *attributed* when the first rank-outlier alarm inside its window names
exactly the faulty rank; alarms outside any window are wrong accusations. A fault-free run counts
accusations on clean training and then times back-to-back ``ControlSync.reduce`` calls with the
gather (``ranks=True``) and without (the plain ``all_reduce``): the collective overhead.

Run::

    PYTHONPATH=$PWD python benchmarks/bench_fleet.py            # 2 seeds x 30 faults, 4 ranks
    PYTHONPATH=$PWD python benchmarks/bench_fleet.py --world 3 --seeds 1 --faults 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.adapters.test_ranks import (
    EXPECTED_SIGNAL,
    SLOW_STEPS,
    make_plan,
    run_fleet,
)


def window(kind: str) -> int:
    """Steps a fault of ``kind`` lasts (and may be named in)."""
    return SLOW_STEPS if kind == "slow" else 1


def score_run(res: list[dict[str, Any]], plan: list[tuple[int, str, int]]) -> dict[str, Any]:
    """Per-fault outcome and accusations outside the fault windows, from rank 0's log."""
    log = res[0]["log"]
    identical = all(r["log"] == log for r in res[1:])
    in_window: set[int] = set()
    outcomes = []
    for step, kind, who in plan:
        steps = range(step, step + window(kind))
        in_window.update(steps)
        first = next((log[s] for s in steps if s < len(log) and log[s][1]), None)
        if first is None:
            outcomes.append((kind, "missed", None))
            continue
        named = {int(sig.split("/")[0][4:]) for sig in first[1]}
        signals = {sig.split("/")[1] for sig in first[1]}
        ok = named == {who}
        outcomes.append((kind, "right" if ok else "wrong",
                         (first[0] - step, EXPECTED_SIGNAL[kind] in signals)))
    wrong_clean = [row for row in log if row[1] and row[0] not in in_window]
    return {"outcomes": outcomes, "wrong_clean": wrong_clean, "identical": identical,
            "steps": len(log)}


def detector_us(worlds: tuple[int, ...] = (4, 64, 1024), steps: int = 300) -> dict[int, float]:
    """Median microseconds of one ``RankMonitor.observe`` on clean random matrices."""
    import numpy as np

    from stability.ranks.ranks import RankMonitor

    out = {}
    rng = np.random.default_rng(0)
    for w in worlds:
        mon = RankMonitor([f"h{r}" for r in range(w)])
        mats = rng.lognormal(0.0, 0.1, (steps, w, 5))
        mats[:, :, 4] = 0.0
        ts = []
        for i in range(steps):
            t0 = time.perf_counter()
            mon.observe(i, mats[i])
            ts.append(time.perf_counter() - t0)
        out[w] = 1e6 * statistics.median(ts)
    return out


def main(argv: list[str] | None = None) -> None:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady-state figures (cold start: bench_coldstart.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--faults", type=int, default=30, help="faults per seed")
    ap.add_argument("--clean-steps", type=int, default=300)
    ap.add_argument("--overhead-iters", type=int, default=200)
    args = ap.parse_args(argv)

    outcomes: list[Any] = []
    wrong_clean: list[Any] = []
    clean_steps = 0
    identical = True
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            plan = make_plan(seed=1000 + seed, world=args.world, n_faults=args.faults)
            n_steps = plan[-1][0] + SLOW_STEPS + 6
            d = Path(tmp) / f"seed{seed}"
            d.mkdir()
            sc = score_run(run_fleet(str(d), args.world, plan, n_steps, timeout=900), plan)
            outcomes += sc["outcomes"]
            wrong_clean += sc["wrong_clean"]
            clean_steps += sc["steps"] - sum(window(k) for _, k, _ in plan)
            identical &= sc["identical"]
        d = Path(tmp) / "clean"
        d.mkdir()
        clean = run_fleet(str(d), args.world, [], args.clean_steps, timeout=900,
                          overhead_iters=args.overhead_iters)
        sc = score_run(clean, [])
        wrong_clean += sc["wrong_clean"]
        clean_steps += sc["steps"]
        identical &= sc["identical"]
    wall = time.perf_counter() - t0

    def us(name: str) -> float:
        return statistics.median(r["overhead_us"][name] for r in clean)

    n = len(outcomes)
    right = sum(o[1] == "right" for o in outcomes)
    missed = sum(o[1] == "missed" for o in outcomes)
    wrong = sum(o[1] == "wrong" for o in outcomes)
    print(f"fleet attribution: {args.world} gloo ranks (CPU), DDP + local grad-norm hook, "
          f"{args.seeds} seed(s) x {args.faults} faults, {wall:.0f} s")
    print(f"{'kind':<8}{'faults':>7}{'right':>7}{'missed':>8}{'wrong':>7}"
          f"{'delay (steps)':>15}{'expected signal':>17}")
    for kind in EXPECTED_SIGNAL:
        ks = [o for o in outcomes if o[0] == kind]
        hits = [o for o in ks if o[1] == "right"]
        delay = statistics.mean(o[2][0] for o in hits) if hits else float("nan")
        sig = sum(o[2][1] for o in hits)
        print(f"{kind:<8}{len(ks):>7}{len(hits):>7}{sum(o[1] == 'missed' for o in ks):>8}"
              f"{sum(o[1] == 'wrong' for o in ks):>7}{delay:>15.2f}{sig:>12}/{len(hits)}")
    print(f"attribution accuracy: {right}/{n} = {right / max(n, 1):.1%} right rank "
          f"({missed} missed, {wrong} wrong rank)")
    print(f"wrong-rank accusations on clean steps: {len(wrong_clean)} in {clean_steps} steps")
    for row in wrong_clean[:5]:
        print("   ", row[0], row[4])
    g, a = us("gather"), us("all_reduce")
    print(f"collective per step (median of {args.overhead_iters} back-to-back calls, "
          f"{args.world} ranks, CPU gloo): ControlSync(ranks=True) one all_gather of "
          f"control+signals + detector {g:.0f} us vs ControlSync() one all_reduce {a:.0f} us "
          f"(+{g - a:.0f} us)")
    det = detector_us()
    print("detector + ledger alone (RankMonitor.observe, numpy): "
          + ", ".join(f"{w} ranks {t:.0f} us" for w, t in det.items()))
    print(f"decisions identical on every rank: {identical}")
    print()
    print("| figure | value |\n|---|---|")
    print(f"| faults injected (NaN / 5x grad / 5x slow, {args.world} ranks) | {n} |")
    print(f"| right rank named | {right / max(n, 1):.1%} ({right}/{n}) |")
    print(f"| wrong-rank accusations on clean steps | {len(wrong_clean)} / {clean_steps} |")
    print(f"| per-step collective, gather+detector vs all_reduce | {g:.0f} us vs {a:.0f} us |")
    print("| detector per step | "
          + ", ".join(f"{t:.0f} us ({w} ranks)" for w, t in det.items()) + " |")


if __name__ == "__main__":
    main()
