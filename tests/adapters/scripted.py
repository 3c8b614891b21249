"""Monitor stand-ins shared by the adapter tests of the sync modes."""

from __future__ import annotations

from typing import Any

from stability.monitor.monitor import Monitor
from stability.run.checkpoints import CheckpointLedger
from stability.types import Control, Decision


class ScriptedMonitor:
    """A monitor that answers a script of controls and records the steps it observes.

    ``once=True``: each scripted control fires once (a step observed again -- after a rollback
    -- gets a plain ``Control()``); ``once=False``: every time its step is observed.
    """

    def __init__(self, script: dict[int, Control] | None = None, *, once: bool = True) -> None:
        self.script = dict(script or {})
        self.once = once
        self.seen: list[int] = []
        self.checkpoints = CheckpointLedger()

    def observe(self, step: int, metrics: Any = None, families: Any = None) -> Decision:
        self.seen.append(step)
        get = self.script.pop if self.once else self.script.get
        return Decision(step, control=get(step, Control()))

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, sd: Any) -> None:
        pass


def watch(mon: Monitor) -> list[tuple[int, dict[str, float], dict[str, list[float]]]]:
    """Record every (step, scalars, families) ``mon`` observes."""
    seen: list[tuple[int, dict[str, float], dict[str, list[float]]]] = []
    observe = mon.observe

    def spy(step: int, metrics: Any = None, **kw: Any) -> Decision:
        fams = {k: [float(x) for x in v] for k, v in (kw.get("families") or {}).items()}
        seen.append((step, dict(metrics or {}), fams))
        return observe(step, metrics, **kw)

    mon.observe = spy  # type: ignore[method-assign,assignment]
    return seen
