"""Which rank is the culprit: attribution accuracy over many injected faults, on gloo CPU ranks.

Each run is one gloo process group (``--world`` ranks, a tiny MLP under DDP with the local
gradient-norm hook, ``ControlSync(ranks=True)``) training for a few hundred steps while a seeded
plan injects faults on one rank at a time, with clean steps between them: a NaN loss, a 5x
gradient scale (a bit-flip-like corruption of one replica's gradient) and a 5x slowdown (three
slow steps). A fault is *attributed* when the first rank-outlier alarm inside its window names
exactly the faulty rank; alarms outside any window are wrong accusations. A fault-free run counts
accusations on clean training, and a run without the gather (``ranks=False``: the plain
``all_reduce``) gives the collective overhead.

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

from tests.adapters.test_ranks import (  # noqa: E402
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--faults", type=int, default=30, help="faults per seed")
    ap.add_argument("--clean-steps", type=int, default=300)
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
        runs = {}
        for gather in (True, False):
            d = Path(tmp) / f"clean-{gather}"
            d.mkdir()
            runs[gather] = run_fleet(str(d), args.world, [], args.clean_steps, gather=gather,
                                     timeout=900)
        sc = score_run(runs[True], [])
        wrong_clean += sc["wrong_clean"]
        clean_steps += sc["steps"]
        identical &= sc["identical"]
    wall = time.perf_counter() - t0

    def us(res: list[dict[str, Any]]) -> float:
        # skip the first steps (DDP bucket rebuild, lazy init)
        return 1e6 * statistics.median(t for r in res for t in r["reduce_s"][10:])

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
    g, a = us(runs[True]), us(runs[False])
    print(f"collective per step (median, {args.world} ranks, CPU gloo, shared 2-core box): "
          f"all_gather of control+signals {g:.0f} us vs all_reduce of control only {a:.0f} us "
          f"(+{g - a:.0f} us, includes the detector)")
    print(f"decisions identical on every rank: {identical}")
    print()
    print("| figure | value |\n|---|---|")
    print(f"| faults injected (NaN / 5x grad / 5x slow, {args.world} ranks) | {n} |")
    print(f"| right rank named | {right / max(n, 1):.1%} ({right}/{n}) |")
    print(f"| wrong-rank accusations on clean steps | {len(wrong_clean)} / {clean_steps} |")
    print(f"| per-step collective, gather vs all_reduce | {g:.0f} us vs {a:.0f} us |")


if __name__ == "__main__":
    main()
