"""WandbSink: alerts reach ``wandb.alert`` (a fake module), failures stay contained."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from stability.monitor.monitor import Monitor
from stability.outputs.wandb_sink import WandbSink
from stability.types import Alert


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    mod = types.ModuleType("wandb")
    mod.alert = lambda **kw: sent.append(kw)  # type: ignore[attr-defined]
    mod.AlertLevel = types.SimpleNamespace(INFO="I", WARN="W", ERROR="E")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return sent


def test_levels_titles_and_text(fake_wandb: list[dict[str, Any]]) -> None:
    sink = WandbSink(min_severity="info", wait_duration=60)
    sink.send(Alert(7, "L3", severity="critical", cause="outlier", message="step 7: NaN loss"))
    sink.send(Alert(8, "L1", severity="warning", message="spike"))
    sink.send(Alert(9, "L0", severity="info", message="fyi"))
    assert [s["level"] for s in fake_wandb] == ["E", "W", "I"]
    assert fake_wandb[0]["title"] == "[stability] CRITICAL (outlier)"
    assert "NaN loss" in fake_wandb[0]["text"] and "step 7" in fake_wandb[0]["text"]
    assert all(s["wait_duration"] == 60 for s in fake_wandb)
    assert sink.stats["sent"] == 3


def test_min_severity_filters(fake_wandb: list[dict[str, Any]]) -> None:
    sink = WandbSink()  # warning and above
    sink.send(Alert(1, "x", severity="info", message="quiet"))
    assert fake_wandb == []


def test_a_run_object_is_used_when_given(fake_wandb: list[dict[str, Any]]) -> None:
    got: list[dict[str, Any]] = []
    run = types.SimpleNamespace(alert=lambda **kw: got.append(kw))
    WandbSink(run=run).send(Alert(3, "r", severity="critical", message="stop"))
    assert len(got) == 1 and fake_wandb == []


def test_failures_are_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("wandb")

    def boom(**kw: Any) -> None:
        raise RuntimeError("You must call wandb.init() before wandb.alert()")

    mod.alert = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    sink = WandbSink()
    sink.send(Alert(1, "x", severity="critical", message="m"))
    assert sink.stats["failed"] == 1 and sink.stats["sent"] == 0


def test_missing_wandb_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    sink = WandbSink()
    sink.send(Alert(1, "x", severity="critical", message="m"))
    assert sink.stats["failed"] == 1


def test_monitor_sends_its_alerts_to_wandb(fake_wandb: list[dict[str, Any]]) -> None:
    mon = Monitor("default", alert_sinks=[WandbSink()], handler_timeout=None)
    alerts = []
    for s in range(60):
        d = mon.observe(s, {"loss": float("nan") if s == 50 else 2.0 + 0.01 * (s % 3)})
        alerts += [i for i in d.interventions if isinstance(i, Alert)
                   and i.severity in ("warning", "critical")]
    assert alerts
    assert len(fake_wandb) == len(alerts)
    assert all(f"step {a.step}" in s["text"] for a, s in zip(alerts, fake_wandb, strict=True))
