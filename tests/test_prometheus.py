"""PrometheusExporter: values follow the monitor; the HTTP endpoint is scraped over loopback."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from replay.watch import Watcher  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.outputs.prometheus import PrometheusExporter  # noqa: E402


def _feed(mon: Monitor, exp: PrometheusExporter | None, n: int = 120) -> list:
    out = []
    for s in range(n):
        loss = 2.0 + 0.01 * (s % 5)
        if s == 80:
            loss = 60.0
        if s == 100:
            loss = float("nan")
        d = mon.observe(s, {"loss": loss, "lr": 1e-3, "grad_norm": 1.0 + 0.01 * (s % 3)})
        if exp is not None:
            exp.update(d)
        out.append(d)
    return out


def test_update_counts_what_the_decisions_hold() -> None:
    t = [1000.0]
    mon = Monitor("default", alert_sinks=[])
    exp = PrometheusExporter(mon, clock=lambda: t[0])
    ds = _feed(mon, exp)
    kinds: dict[str, int] = {}
    for d in ds:
        for a in d.alarms:
            kinds[a.kind] = kinds.get(a.kind, 0) + 1
    assert kinds  # the run alarms
    for k, v in kinds.items():
        assert exp.value("stability_alarms_total", kind=k) == v
    skips = sum(i.type == "skip_step" for d in ds for i in d.interventions)
    assert exp.value("stability_interventions_total", type="skip_step") == (skips or None)
    assert exp.value("stability_steps_total") == 120
    assert exp.value("stability_last_step") == 119
    assert exp.value("stability_lr_factor") == mon.control.lr_factor
    assert exp.value("stability_escalation_level") == mon.policy.level_at(119)
    assert exp.value("stability_goodput_fraction") == pytest.approx((120 - skips) / 120)
    t[0] += 12.5
    assert exp.value("stability_last_step_age_seconds") == pytest.approx(12.5)
    clip = exp.value("stability_clip_norm")
    assert (math.isnan(clip) if mon.control.clip_norm is None
            else clip == mon.control.clip_norm)


def test_attached_to_an_in_process_monitor() -> None:
    mon = Monitor("default", alert_sinks=[], handler_timeout=None)
    exp = PrometheusExporter(mon, attach=True)
    ds = _feed(mon, None)
    n_alarms = sum(len(d.alarms) for d in ds)
    got = sum(s.value for m in exp.registry.collect() if m.name == "stability_alarms"
              for s in m.samples if s.name == "stability_alarms_total")
    assert got == n_alarms > 0
    assert exp.value("stability_last_step") == 119
    assert exp.value("stability_steps_total") == 120


def test_http_endpoint_scraped_over_loopback() -> None:
    mon = Monitor("default", alert_sinks=[])
    exp = PrometheusExporter(mon, port=0, addr="127.0.0.1")
    try:
        _feed(mon, exp)
        with urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        exp.close()
    assert 'stability_alarms_total{kind="loss_spike"}' in text
    assert "stability_last_step 119.0" in text
    assert "stability_last_step_age_seconds" in text


def test_watch_feeds_the_exporter(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 60.0 if s == 80 else 2.0 + 0.01 * (
        s % 5)}) + "\n" for s in range(120)))
    w = Watcher([str(log)], "default", echo=None)
    w.exporter = PrometheusExporter(w.monitor)
    w.run(once=True)
    assert w.exporter.value("stability_last_step") == 119
    assert w.exporter.value("stability_alarms_total", kind="loss_spike") >= 1


def test_two_exporters_do_not_collide() -> None:
    a = PrometheusExporter(Monitor("default", alert_sinks=[]))
    b = PrometheusExporter(Monitor("default", alert_sinks=[]))
    assert a.registry is not b.registry
    assert a.value("stability_last_step") == -1
