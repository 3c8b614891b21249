"""``[alerts]`` / ``[event_log]`` config sections and the sink factories built from them."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from stability.config.config import (
    AlertsConfig,
    ConfigError,
    EventLogConfig,
    MonitorConfig,
    load_config,
)
from stability.monitor.monitor import Monitor
from stability.outputs.alerts import (
    FileSink,
    LoggingSink,
    WebhookSink,
    event_log_from_config,
    format_slack,
    sinks_from_config,
)
from stability.outputs.events import EventLog, read_events
from stability.types import Alert
from tests.test_alerts import _Server

TOML = """
preset = "small"

[alerts]
file = "{file}"
min_severity = "warning"

[alerts.webhook]
url_env = "STABILITY_TEST_HOOK"
format = "slack"
max_per_window = 2
window_s = 3600.0
mention = "<!here>"

[event_log]
path = "{events}"
fsync = "always"
"""


@pytest.fixture()
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


def _cfg(tmp_path: Path) -> MonitorConfig:
    path = tmp_path / "mon.toml"
    path.write_text(TOML.format(file=tmp_path / "alerts.log", events=tmp_path / "ev.jsonl"))
    return load_config(path)


def test_defaults_and_round_trip(tmp_path: Path) -> None:
    cfg = load_config()
    assert cfg.alerts == AlertsConfig() and cfg.alerts.log and cfg.alerts.webhook is None
    assert cfg.event_log == EventLogConfig() and cfg.event_log.path is None
    assert "alerts" not in cfg.to_dict() and "event_log" not in cfg.to_dict()
    full = _cfg(tmp_path)
    assert full.preset == "small" and full.alerts.webhook is not None
    assert full.alerts.webhook.mention == "<!here>" and full.event_log.fsync == "always"
    assert MonitorConfig.from_dict(full.to_dict()) == full
    assert MonitorConfig.from_json(full.to_json(indent=1)) == full


def test_preset_sections_merge_recursively() -> None:
    cfg = MonitorConfig.from_dict({"preset": "small", "alerts": {"log": False}})
    assert not cfg.alerts.log and cfg.alerts.min_severity == "warning"


@pytest.mark.parametrize(("doc", "match"), [
    ({"alerts": {"lgo": True}}, r"alerts: unknown key 'lgo' \(did you mean 'log'\?\)"),
    ({"alerts": {"log": "yes"}}, r"alerts.log: must be true or false"),
    ({"alerts": {"min_severity": "loud"}}, r"alerts.min_severity: must be one of"),
    ({"alerts": {"webhook": {}}}, r"alerts.webhook: needs 'url' or 'url_env'"),
    ({"alerts": {"webhook": {"url": "ftp://x"}}}, r"alerts.webhook.url: must be an http"),
    ({"alerts": {"webhook": {"url": "https://x", "format": "teams"}}},
     r"alerts.webhook.format: must be one of slack, plain"),
    ({"alerts": {"webhook": {"url": "https://x", "max_per_window": 0}}},
     r"alerts.webhook.max_per_window: must be an int in the range \[1, inf\); got 0"),
    ({"alerts": {"webhook": {"url": "https://x", "window_s": -1}}},
     r"alerts.webhook.window_s: must be a finite float in the range \(0.0, inf\)"),
    ({"event_log": {"fsync": "sometimes"}}, r"event_log.fsync: must be one of"),
    ({"event_log": {"pth": "x"}}, r"event_log: unknown key 'pth'"),
    ({"alert": {}}, r"config: unknown key 'alert' \(did you mean 'alerts'\?\)"),
])
def test_errors_name_the_key(doc: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MonitorConfig.from_dict(doc)


def test_sinks_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           server: _Server, caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(tmp_path)
    monkeypatch.delenv("STABILITY_TEST_HOOK", raising=False)
    with caplog.at_level(logging.WARNING, logger="stability.alerts"):
        sinks = sinks_from_config(cfg)
    assert [type(s) for s in sinks] == [LoggingSink, FileSink]  # missing secret: no webhook
    assert "STABILITY_TEST_HOOK is not set" in caplog.text
    monkeypatch.setenv("STABILITY_TEST_HOOK", server.url + "/ok")
    sinks = sinks_from_config(cfg.alerts)
    assert [type(s) for s in sinks] == [LoggingSink, FileSink, WebhookSink]
    hook = sinks[2]
    assert isinstance(hook, WebhookSink)
    for s in range(4):  # two warnings pass the rate limit, the third is coalesced
        hook.send(Alert(s, "r", severity="warning", message=f"warn {s}"))
    hook.send(Alert(9, "r", severity="critical", message="stop"))  # escalation: always goes
    assert hook.flush(5.0)
    hook.close(1.0)
    texts = [b["text"] for b in server.bodies]
    assert len(texts) == 3 and all("blocks" in b for b in server.bodies)
    crit = [t for t in texts if "CRITICAL" in t]
    assert crit and crit[0].startswith("<!here> :rotating_light:")
    assert "+2 more alerts suppressed" in crit[0]
    sinks[1].send(Alert(3, "r", severity="info", message="below min_severity"))
    sinks[1].send(Alert(4, "r", severity="warning", message="kept"))
    lines = (tmp_path / "alerts.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].endswith("WARNING step 4: kept")


def test_event_log_from_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    log = event_log_from_config(cfg)
    assert isinstance(log, EventLog) and log.fsync == "always"
    mon = Monitor(cfg, event_log=log, alert_sinks=[])
    mon.observe(0, {"loss": float("nan")})
    log.close()
    kinds = [e["type"] for e in read_events(tmp_path / "ev.jsonl")]
    assert "alarm" in kinds and "intervention" in kinds
    assert event_log_from_config(load_config()) is None
    assert event_log_from_config({"path": str(tmp_path / "b.jsonl")}).fsync == "critical"


def test_slack_payload() -> None:
    p = format_slack(Alert(3, "r", severity="warning", message="clip"), suppressed=1,
                     mention="<!here>")
    assert p["text"].startswith(":warning: [stability] WARNING step 3: clip")  # no mention
    assert p["blocks"][0]["text"]["type"] == "mrkdwn"
    assert "+1 more" in p["blocks"][0]["text"]["text"]


def _nan_run(mon: Monitor) -> None:
    for s in range(5):
        mon.observe(s, {"loss": 1.0, "grad_norm": 1.0})
    d = mon.observe(5, {"loss": float("nan"), "grad_norm": 1.0})
    assert any(iv.type == "skip_step" for iv in d.interventions)


def test_nan_alarm_and_skip_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config("small")
    with caplog.at_level(logging.DEBUG, logger="stability"):
        _nan_run(Monitor(cfg, alert_sinks=sinks_from_config(cfg)))
    recs = [r for r in caplog.records if r.name == "stability.alerts"]
    assert recs and max(r.levelno for r in recs) >= logging.WARNING
    assert "nonfinite(loss)" in recs[0].getMessage() and "skip" in recs[0].getMessage()


def test_monitor_logs_by_default(caplog: pytest.LogCaptureFixture) -> None:
    if not Monitor().alert_sinks:
        pytest.skip("Monitor() does not build its default sinks from [alerts] yet "
                    "(monitor.py hook: alert_sinks = sinks_from_config(self.config.alerts))")
    with caplog.at_level(logging.WARNING, logger="stability"):
        _nan_run(Monitor("small"))
    assert any(r.name == "stability.alerts" and r.levelno >= logging.WARNING
               for r in caplog.records)
