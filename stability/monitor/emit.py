"""The monitor's output side: decisions to the event log, the handlers and the alert sinks.

The emitting methods are :class:`~stability.monitor.monitor.Monitor`'s own (its "emit"
section); this module holds the decision constructor and the names of non-finite values.
"""

from __future__ import annotations

import logging

from stability.types import Alarm, Control, Decision, Intervention

__all__ = ["NF_NAMES", "new_decision"]

logger = logging.getLogger("stability.monitor")

_new = object.__new__
NF_NAMES = {1.0: "NaN", 2.0: "+inf", 3.0: "-inf"}  # the nonfinite kernel's scores


def new_decision(step: int, alarms: tuple[Alarm, ...], ivs: tuple[Intervention, ...],
              control: Control, skipped: tuple[str, ...]) -> Decision:
    d = _new(Decision)  # frozen: the fields go straight into the instance dict
    f = d.__dict__
    f["step"] = step
    f["alarms"] = alarms
    f["interventions"] = ivs
    f["control"] = control
    f["skipped"] = skipped
    return d


