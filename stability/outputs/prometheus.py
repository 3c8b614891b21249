"""Prometheus metrics of a monitor (optional: ``pip install training-stability[prometheus]``).

:class:`PrometheusExporter` exposes, at scrape time:

==========================================  ================================================
``stability_alarms_total{kind}``            alarms by kind (counter)
``stability_interventions_total{type}``     interventions by type (counter)
``stability_steps_total``                   steps the monitor judged (counter)
``stability_escalation_level``              the policy's escalation level now (0 = calm)
``stability_lr_factor``                     the LR multiplier the monitor requests (1 = none)
``stability_clip_norm``                     the gradient clip it requests (NaN = trainer's own)
``stability_goodput_fraction``              productive / executed steps (see below)
``stability_last_step``                     the last step judged (-1 = none yet)
``stability_last_step_age_seconds``         seconds since that step was judged
==========================================  ================================================

The HTTP endpoint (``port=``) is served by one thread with a bounded number of clients and a
deadline per client (:mod:`stability.outputs.scrape_server`): slow or stuck scrapers cost
neither threads nor time of the training process.

Feed it either way:

* ``exporter.update(decision)`` after every ``monitor.observe(...)`` (what ``stability watch
  --prometheus-port N`` does): exact counts and step ages;
* ``PrometheusExporter(monitor, attach=True)``: the exporter registers itself as the monitor's
  ``on_alarm`` / ``on_intervention`` handler (counts arrive through the handlers), and reads the
  last step at scrape time -- its age is then measured from the scrape (or alarm) that first saw
  it, so it is late by at most one scrape interval.

Goodput: the monitor's own goodput ledger when it has one (``monitor.goodput.fraction``);
otherwise the exporter counts it from the decisions it sees -- ``(steps - skipped - rolled back)
/ steps`` -- the same counterfactual figure as :func:`replay.replay.goodput` without a stop.

Examples
--------
>>> from stability.monitor.monitor import Monitor
>>> from stability.outputs.prometheus import PrometheusExporter
>>> mon = Monitor("default", alert_sinks=[])
>>> exp = PrometheusExporter(mon)              # a private registry, no HTTP server
>>> for s in range(3):
...     exp.update(mon.observe(s, {"loss": 2.0}))
>>> exp.value("stability_last_step"), exp.value("stability_steps_total")
(2.0, 3.0)
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

from stability.outputs.scrape_server import ScrapeServer

__all__ = ["PrometheusExporter"]


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "PrometheusExporter needs prometheus_client: pip install "
            "'training-stability[prometheus]' (or prometheus_client>=0.17)") from exc
    return prometheus_client


class PrometheusExporter:
    """Expose a :class:`~stability.monitor.monitor.Monitor`'s health as Prometheus metrics.

    Parameters
    ----------
    monitor
        The monitor to expose.
    port
        Serve ``/metrics`` over HTTP on this port (``0``: any free port, see :attr:`port`);
        ``None``: no server (scrape :attr:`registry` yourself, or use ``generate_latest``).
    registry
        A ``prometheus_client.CollectorRegistry`` (default: a new private one; pass
        ``prometheus_client.REGISTRY`` to join the process-wide one).
    addr
        Address the server binds (default ``"127.0.0.1"``: this machine only; ``"0.0.0.0"``
        exposes the metrics to the network -- a deliberate choice, e.g. for a scraper on
        another host).
    attach
        Register as the monitor's alarm / intervention handler (for monitors you do not
        drive through :meth:`update`).
    clock
        Time source (default :func:`time.time`).
    max_clients, client_timeout
        Bounds of the HTTP server (:class:`~stability.outputs.scrape_server.ScrapeServer`):
        one thread serves every client; at most ``max_clients`` (default 16) connections at
        once, each closed ``client_timeout`` seconds (default 5) after it connected, so slow
        clients can neither add threads to the training process nor hold the exporter.
    """

    def __init__(self, monitor: Any, port: int | None = None, registry: Any = None, *,
                 addr: str = "127.0.0.1", attach: bool = False, clock: Any = None,
                 max_clients: int = 16, client_timeout: float = 5.0) -> None:
        pc = _client()
        self.monitor = monitor
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self.clock = clock or time.time
        self.alarms: collections.Counter[str] = collections.Counter()
        self.interventions: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.skipped = 0
        self.rolled_back = 0
        self._lock = threading.Lock()
        self._step = -1
        self._step_time: float | None = None
        self.attached = attach
        if attach:
            monitor.on_alarm(self._on_alarm)
            monitor.on_intervention(self._on_intervention)
        self.registry.register(_Collector(self))
        self.server: ScrapeServer | None = None
        self.port: int | None = None
        if port is not None:
            registry = self.registry
            self.server = ScrapeServer(lambda: pc.generate_latest(registry), port, addr,
                                       max_clients=max_clients, client_timeout=client_timeout)
            self.port = self.server.server_port

    # ------------------------------------------------------------------ feeding
    def update(self, decision: Any) -> None:
        """Count one judged step (call after every ``monitor.observe``)."""
        with self._lock:
            self.steps += 1
            self._step, self._step_time = int(decision.step), self.clock()
            if not self.attached:
                for a in decision.alarms:
                    self.alarms[a.kind] += 1
                for iv in decision.interventions:
                    self._count_iv(iv)

    def _count_iv(self, iv: Any) -> None:
        self.interventions[iv.type] += 1
        if iv.type == "skip_step":
            self.skipped += 1
        elif iv.type == "rollback":
            self.rolled_back += max(0, int(iv.step) - int(getattr(iv, "to_step", iv.step)))

    def _on_alarm(self, alarm: Any) -> None:
        with self._lock:
            self.alarms[alarm.kind] += 1

    def _on_intervention(self, iv: Any) -> None:
        with self._lock:
            self._count_iv(iv)

    def close(self) -> None:
        """Stop the HTTP server (if any)."""
        if self.server is not None:
            self.server.close()
            self.server = None

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> dict[str, Any]:
        """The current values (what a scrape returns), as plain data."""
        mon = self.monitor
        with self._lock:
            last = int(getattr(mon, "last_step", self._step))
            if last != self._step and last >= 0:  # a step judged without update()
                self._step, self._step_time = last, self.clock()
            age = math.nan if self._step_time is None else max(0.0, self.clock()
                                                                 - self._step_time)
            steps = self.steps if self.steps else int(mon.counters.get("steps", 0))
            alarms = dict(self.alarms)
            ivs = dict(self.interventions)
            lost = self.skipped + self.rolled_back
        ctrl = mon.control
        level_at = getattr(getattr(mon, "policy", None), "level_at", None)
        level = level_at(max(last, 0)) if level_at is not None else math.nan
        ledger = getattr(mon, "goodput", None)  # a goodput ledger, if the monitor has one
        if ledger is not None and hasattr(ledger, "fraction"):
            good = float(ledger.fraction)
        else:
            good = (steps - lost) / steps if steps else math.nan
        return {"alarms": alarms, "interventions": ivs, "steps": steps,
                "level": float(level), "lr_factor": float(ctrl.lr_factor),
                "clip_norm": math.nan if ctrl.clip_norm is None else float(ctrl.clip_norm),
                "goodput": max(0.0, good) if good == good else good, "last_step": last,
                "age": age}

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's value from :attr:`registry` (``None`` if absent)."""
        v = self.registry.get_sample_value(name, labels or None)
        return None if v is None else float(v)


class _Collector:
    """Reads the exporter at scrape time."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self.exporter = exporter

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        s = self.exporter.snapshot()
        c = CounterMetricFamily("stability_alarms", "Alarms raised, by kind", labels=["kind"])
        for k, v in sorted(s["alarms"].items()):
            c.add_metric([k], v)
        yield c
        c = CounterMetricFamily("stability_interventions", "Interventions requested, by type",
                                labels=["type"])
        for k, v in sorted(s["interventions"].items()):
            c.add_metric([k], v)
        yield c
        yield CounterMetricFamily("stability_steps", "Steps judged", value=s["steps"])
        gauges = (
            ("stability_escalation_level", "Escalation level of the policy (0 = calm)", "level"),
            ("stability_lr_factor", "LR multiplier requested (1 = untouched)", "lr_factor"),
            ("stability_clip_norm", "Gradient clip requested (NaN = the trainer's own)",
             "clip_norm"),
            ("stability_goodput_fraction", "Productive / executed steps", "goodput"),
            ("stability_last_step", "Last step judged (-1 = none)", "last_step"),
            ("stability_last_step_age_seconds", "Seconds since the last step was judged",
             "age"),
        )
        for name, doc, key in gauges:
            yield GaugeMetricFamily(name, doc, value=float(s[key]))
