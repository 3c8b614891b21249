"""stability: watch training runs, catch instability within steps, act before the run is lost."""

from .config import MonitorConfig
from .monitor import Monitor
from .types import (
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
    "Checkpoint",
    "Control",
    "Decision",
    "Intervention",
    "Monitor",
    "MonitorConfig",
    "ReduceLR",
    "Rollback",
    "SetClip",
    "SkipStep",
    "Stop",
]
