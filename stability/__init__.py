"""stability: watch training runs, catch instability within steps, act before the run is lost.

What users construct and catch is importable from here::

    from stability import Monitor, load_config, ConfigError, EventLog, WebhookSink

The PyTorch adapter is one import away (``import stability.torch``; it imports torch);
Lightning and HF callbacks live in :mod:`stability.adapters.lightning` and
:mod:`stability.adapters.hf`.
"""

from stability.config.config import MonitorConfig, load_config
from stability.config.presets import list_presets
from stability.config.registry import ConfigError, known_detectors, register_detector
from stability.monitor.bound import BoundInputs
from stability.monitor.decisions import Decisions
from stability.monitor.monitor import Monitor
from stability.outputs.alerts import AlertSink, FileSink, LoggingSink, WebhookSink
from stability.outputs.events import EventLog, read_events
from stability.outputs.handlers import HandlerError
from stability.types import (
    ALARM_KINDS,
    Alarm,
    Alert,
    Checkpoint,
    Control,
    Decision,
    Intervention,
    ReduceLR,
    Rollback,
    SetClip,
    SkipStep,
    Stop,
)

__version__ = "0.1.0"

__all__ = [
    "ALARM_KINDS",
    "Alarm",
    "Alert",
    "AlertSink",
    "BoundInputs",
    "Checkpoint",
    "ConfigError",
    "Control",
    "Decision",
    "Decisions",
    "EventLog",
    "FileSink",
    "HandlerError",
    "Intervention",
    "LoggingSink",
    "Monitor",
    "MonitorConfig",
    "ReduceLR",
    "Rollback",
    "SetClip",
    "SkipStep",
    "Stop",
    "WebhookSink",
    "__version__",
    "known_detectors",
    "list_presets",
    "load_config",
    "read_events",
    "register_detector",
]
