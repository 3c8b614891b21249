"""Time and size bounds of the monitor's inputs and side effects (issue 12, classes 3 and 4).

Three measurements, printed as one line each:

* **handler storm** -- a hung ``on_alarm`` handler plus ``--steps`` alarming steps (two alarms
  and a few interventions each) with ``handler_budget_s = --budget``: worst and median
  ``observe()`` time, threads alive at the peak, calls made to the hung handler, calls dropped.
* **trickling webhook** -- a local server that sends one header line every 0.2 s forever; a
  :class:`~stability.outputs.alerts.WebhookSink` with ``timeout = --webhook-timeout``: seconds
  until the
  request is given up and whether the failure was reported.
* **new name every step** -- ``--names`` steps, each with a metric name never seen before, on the
  ``default`` preset (``max_series`` 4096): mean ``observe()`` time over the last 1000 steps and
  the size of the ``"*"`` bank.
* **NaN storm with the event log on** (issue 27) -- ``--storm-steps`` all-NaN steps at
  ``--layers`` layers (4 activation statistics + a gradient norm per layer) on the ``default``
  preset, with an event log (``fsync="critical"``), the logging alert sink and a counting sink:
  worst and median ``observe()`` against ``handler_budget_s``, event-log records, bytes and
  fsyncs, alerts delivered and coalesced.  The promise: worst ``observe()`` within the budget,
  alerts bounded per episode.

Run::

    python benchmarks/bench_time_bounds.py
    python benchmarks/bench_time_bounds.py --budget 1.0 --steps 100 --names 20000
    python benchmarks/bench_time_bounds.py --only storm --layers 512 --storm-steps 1000
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from stability.monitor.monitor import Monitor
from stability.outputs.alerts import WebhookSink
from stability.types import Alert

NAN_ONLY = {"detectors": [{"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"],
                           "kind": "nonfinite"}]}


def handler_storm(budget: float, steps: int) -> str:
    warm = Monitor(NAN_ONLY, alert_sinks=[], handler_timeout=None)
    for s in range(3):
        warm.observe(s, {"loss": math.nan})
    release = threading.Event()
    calls = []

    def hang(alarm: object) -> None:
        calls.append(alarm)
        release.wait(600)

    before = threading.active_count()
    mon = Monitor(NAN_ONLY, on_alarm=hang, handler_timeout=budget)
    times, peak = [], 0
    for s in range(steps):
        t0 = time.perf_counter()
        mon.observe(s, {"loss": math.nan, "grad_norm": math.inf})
        times.append(time.perf_counter() - t0)
        peak = max(peak, threading.active_count())
    release.set()
    return (f"handler storm: budget {budget} s, {steps} alarming steps: worst observe() "
            f"{max(times):.3f} s, median {statistics.median(times) * 1e3:.2f} ms, threads "
            f"+{peak - before} at the peak, hung handler called {len(calls)}x, "
            f"{getattr(mon.handlers, 'n_dropped', 0)} calls dropped")


def trickling_webhook(timeout: float) -> str:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    stop = threading.Event()

    def serve() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            i = 0
            while not stop.wait(0.2):
                conn.sendall(f"X-Trickle-{i}: a\r\n".encode())
                i += 1
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    reports: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reports.append(record.getMessage())

    log = logging.getLogger("stability.alerts")
    catcher = Catch(logging.WARNING)
    log.addHandler(catcher)
    try:
        sink = WebhookSink(f"http://127.0.0.1:{srv.getsockname()[1]}/h", timeout=timeout)
        t0 = time.perf_counter()
        sink.send(Alert(1, "r", severity="critical", message="x"))
        drained = sink.flush(60.0)
        took = time.perf_counter() - t0
        sink.close(1.0)
    finally:
        log.removeHandler(catcher)
        stop.set()
        srv.close()
    return (f"trickling webhook: timeout {timeout} s: given up after {took:.2f} s "
            f"(drained={drained}), failed={sink.stats['failed']}, reports={len(reports)}")


def new_names(n: int) -> str:
    mon = Monitor("default", alert_sinks=[])
    logging.getLogger("stability.monitor").setLevel(logging.ERROR)
    last = []
    for s in range(n):
        t0 = time.perf_counter()
        mon.observe(s, {"loss": 2.0, "grad_norm": 1.0, f"metric_{s}": 1.0})
        if s >= n - 1000:
            last.append(time.perf_counter() - t0)
    bank = max(len(mon.series(b.name)) for b in mon.config.detectors)
    return (f"new name every step: {n} names: {statistics.mean(last) * 1e6:.1f} µs/step over "
            f"the last 1000 steps; largest bank {bank} series (max_series "
            f"{getattr(mon, 'max_series', None)})")


def nan_storm(layers: int, steps: int) -> str:
    import os
    import tempfile

    import numpy as np

    from stability.outputs.alerts import AlertSink, LoggingSink
    from stability.outputs.events import EventLog

    class Counting(AlertSink):
        name = "counting"

        def _send(self, alert: Alert) -> None:
            pass

    fams = ("act_mean", "act_std", "act_absmax", "act_kurtosis", "grad_norm")
    names = [f"L{i}" for i in range(layers)]
    rng = np.random.default_rng(0)
    path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
    log = EventLog(path, fsync="critical")
    counting, logging_sink = Counting(), LoggingSink()
    mon = Monitor("default", event_log=log, alert_sinks=[logging_sink, counting])
    for f in fams:
        mon.declare_family(f, names)
    healthy = 300
    times = []
    nan = np.full(layers, math.nan)
    for t in range(healthy + steps):
        bad = t >= healthy
        m = {"loss": math.nan if bad else 2.0 + 0.01 * rng.standard_normal(),
             "grad_norm": math.nan if bad else 1.0 + 0.01 * rng.standard_normal(), "lr": 1e-3}
        f = {k: nan if bad else np.exp(rng.normal(0.0, 0.03, layers)) for k in fams}
        t0 = time.perf_counter()
        mon.observe(t, m, f)
        if bad:
            times.append(time.perf_counter() - t0)
    budget = mon.config.monitor.handler_budget_s
    synced = log.wait_synced(30.0)
    n_fsync = log.n_fsyncs
    mon.close()
    log.close()
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        records = sum(1 for _ in fh)
    return (f"NaN storm: {layers} layers, {steps} all-NaN steps, event log on: worst observe() "
            f"{max(times) * 1e3:.1f} ms, median {statistics.median(times) * 1e3:.2f} ms "
            f"(handler_budget_s {budget:g} s: {'within' if max(times) <= budget else 'OVER'}); "
            f"event log {records} records, {size / 2**20:.1f} MiB, {n_fsync} fsyncs "
            f"(all synced: {synced}); alerts: {counting.stats['sent']} sent, "
            f"{counting.stats['coalesced']} coalesced (logging sink: "
            f"{logging_sink.stats['sent']} lines)")


def main() -> None:
    from detectors import dispatch

    dispatch.set_mode("blocking")  # steady-state figures (cold start: bench_coldstart.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--webhook-timeout", type=float, default=1.0)
    ap.add_argument("--names", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=512)
    ap.add_argument("--storm-steps", type=int, default=1000)
    ap.add_argument("--only", choices=("handlers", "webhook", "names", "storm"), default=None)
    args = ap.parse_args()
    alerts = logging.getLogger("stability.alerts")
    level = alerts.level
    alerts.setLevel(logging.CRITICAL + 1)  # the storm's alert lines are not the point
    if args.only in (None, "handlers"):
        print(handler_storm(args.budget, args.steps), flush=True)
    if args.only in (None, "storm"):
        print(nan_storm(args.layers, args.storm_steps), flush=True)
    alerts.setLevel(level)
    if args.only in (None, "webhook"):
        print(trickling_webhook(args.webhook_timeout), flush=True)
    if args.only in (None, "names"):
        print(new_names(args.names), flush=True)


if __name__ == "__main__":
    main()
