"""Typed reads of a state dict, with errors that name the field.

Every ``load_state_dict`` of the runtime (Policy, LRGuard, the loss/validation trackers,
CheckpointLedger, GoodputTracker, the monitor, TorchGuard, ...) reads its snapshot through a
:class:`Fields`.  The class lives in :mod:`detectors.validation`, the project's one validation
dialect, shared with the detectors' own snapshots and constructor checks; this module only names
it for the runtime.

Examples
--------
>>> Fields("Policy", {"level": -1}).integer("level", lo=0, hi=4)
Traceback (most recent call last):
...
ValueError: Policy.load_state_dict(): 'level' must be an int in the range [0, 4]; got -1.
"""

from __future__ import annotations

from detectors.validation import STEP_MAX, Fields

__all__ = ["STEP_MAX", "Fields"]
