"""Alerts to Weights & Biases (``wandb.alert``); optional extra ``training-stability[wandb]``.

W&B forwards run alerts to e-mail or Slack as set in the user's / team's settings.  The sink
sends through ``run.alert`` when given a run, else through ``wandb.alert`` (the active run of
``wandb.init``); like every sink it never raises (a missing run or a network error is reported
once through logging and counted in ``stats``).

Examples
--------
>>> import sys, types
>>> sent = []
>>> fake = types.SimpleNamespace(
...     alert=lambda **kw: sent.append(kw),
...     AlertLevel=types.SimpleNamespace(INFO="INFO", WARN="WARN", ERROR="ERROR"))
>>> sys.modules["wandb"] = fake
>>> from stability.types import Alert
>>> WandbSink().send(Alert(7, "L3", severity="critical", message="nonfinite(loss) -> skip"))
>>> sent[0]["title"], sent[0]["level"]
('[stability] CRITICAL', 'ERROR')
>>> del sys.modules["wandb"]
"""

from __future__ import annotations

from typing import Any

from stability.outputs.alerts import AlertSink, _rank, format_alert
from stability.types import Alert

__all__ = ["WandbSink"]

_LEVELS = {"info": "INFO", "warning": "WARN", "critical": "ERROR"}


class WandbSink(AlertSink):
    """Send alerts with ``wandb.alert(title=..., text=..., level=...)``.

    Parameters
    ----------
    run
        A ``wandb`` run (``wandb.init()``'s result); default: the module-level ``wandb.alert``,
        i.e. the active run.
    min_severity
        Drop alerts below this severity (``"info"``, ``"warning"``, ``"critical"``).
    wait_duration
        Seconds W&B waits before sending another alert with the same title (its own
        throttling; ``None``: W&B's default).
    """

    name = "wandb"

    def __init__(self, run: Any = None, min_severity: str = "warning",
                 wait_duration: float | None = None) -> None:
        super().__init__()
        self.run = run
        self.min_severity = min_severity
        self.wait_duration = wait_duration

    def _send(self, alert: Alert) -> None:
        if _rank(alert.severity) < _rank(self.min_severity):
            return
        import wandb  # optional dependency, imported when an alert is sent

        levels = getattr(wandb, "AlertLevel", None)
        name = _LEVELS.get(alert.severity, "WARN")
        level = getattr(levels, name) if levels is not None else name
        cause = f" ({alert.cause})" if getattr(alert, "cause", "") else ""
        kwargs: dict[str, Any] = {"title": f"[stability] {alert.severity.upper()}{cause}",
                                  "text": format_alert(alert, prefix="").strip(),
                                  "level": level}
        if self.wait_duration is not None:
            kwargs["wait_duration"] = self.wait_duration
        target = self.run.alert if self.run is not None else wandb.alert
        target(**kwargs)
