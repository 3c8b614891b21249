"""replay: record runs to Parquet, replay them through the monitor, evaluate and tune offline.

The public entry points, imported on first use (``import replay`` stays cheap)::

    from replay import load_run, RunRecorder, replay_run, evaluate_runs, tune

>>> import replay
>>> replay.replay_run.__module__
'replay.replay'
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> defining module
_EXPORTS = {
    "load_run": "replay.io",
    "detect_format": "replay.io",
    "RunRecorder": "replay.recorder",
    "replay_run": "replay.replay",
    "replay_many": "replay.replay",
    "replay_table": "replay.replay",
    "ReplayResult": "replay.replay",
    "alarms_table": "replay.frames",
    "interventions_table": "replay.frames",
    "episodes_table": "replay.frames",
    "evaluate_runs": "replay.evaluate",
    "RunLabel": "replay.labels",
    "load_labels": "replay.labels",
    "tune": "replay.tuning",
    "write_report": "replay.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'replay' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
