"""Stall watchdog figures: detection latency per threshold, and the cost of a beat.

A fake training loop beats every ``--step-ms`` milliseconds, then hangs; the latency is the time
from the last beat to the stall callback (measured outside the watchdog).  The threshold is the
``min_timeout_s`` floor (``k x`` median step time is below it here).

    python benchmarks/bench_watchdog.py [--trials 3] [--step-ms 10]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
import timeit

from stability.run.watchdog import StallWatchdog


def latency(threshold: float, step_s: float) -> tuple[float, float]:
    """(seconds from the last beat to the stall report, the watchdog's own measurement)."""
    got = threading.Event()
    when: list[float] = []

    def on_stall(ev: object) -> None:
        when.append(time.monotonic())
        got.set()

    wd = StallWatchdog(k=5.0, min_timeout_s=threshold, warmup_steps=3, on_stall=on_stall,
                       dump_stacks=False)
    with wd:
        for s in range(20):
            time.sleep(step_s)
            wd.beat(s)
        last = time.monotonic()
        got.wait(10 * threshold + 5)
    return when[0] - last, wd.stalls[0].duration_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0, 2.0])
    a = ap.parse_args()
    logging.getLogger("stability.watchdog").setLevel(logging.ERROR)
    print(f"step time {a.step_ms:g} ms, {a.trials} trials per threshold")
    print(f"{'threshold s':>12} {'latency s (median)':>19} {'max':>7} {'latency / threshold':>20}")
    for thr in a.thresholds:
        lat = [latency(thr, a.step_ms / 1000)[0] for _ in range(a.trials)]
        med = statistics.median(lat)
        print(f"{thr:12.2f} {med:19.3f} {max(lat):7.3f} {med / thr:20.3f}")
    wd = StallWatchdog(min_timeout_s=60.0, autostart=False)
    n = 200_000
    step = iter(range(10**9)).__next__
    t = timeit.timeit(lambda: wd.beat(step()), number=n)
    base = timeit.timeit(lambda: step(), number=n)
    print(f"beat(): {(t - base) / n * 1e9:.0f} ns per call (thread not running)")
    with StallWatchdog(min_timeout_s=60.0) as wd2:
        t = timeit.timeit(lambda: wd2.beat(step()), number=n)
    print(f"beat(): {(t - base) / n * 1e9:.0f} ns per call (thread running)")


if __name__ == "__main__":
    main()
