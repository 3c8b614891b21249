"""Learning-rate / loss anomalies: schedule bugs, loss rising with the LR, LR past a stable level.

* :class:`LRJump` (input ``lr``) -- ``|dlog lr|`` against the recent typical ``|dlog lr|``:
  warm-up, cosine, linear and constant schedules change the LR smoothly, so a factor-of-10 jump
  in one step is hundreds of typical changes.  Step-decay drops are benign *decreases*; by
  default only increases are scored (``direction="up"``).
* :class:`LRLossCorrelation` (inputs ``loss``, ``lr``) -- rolling Pearson correlation, over the
  last ``window`` steps, of the change of the smoothed log loss with the previous step's change
  of log LR (the LR of step ``t`` shows in the loss of step ``t + 1``), gated so that it only
  counts when the LR went *up* over the window by ``min_lr_ratio`` and the loss went up too.
* :class:`LRLevelInstability` (inputs ``loss``, ``lr``) -- the volatility (EW variance of
  ``dlog loss``) relative to its baseline, scored only while the LR is above ``margin`` times the
  highest LR at which the loss was seen stable.

A non-positive LR (a schedule that starts or ends at 0) is "off": it is never put in a log, it
scores 0 in :class:`LRJump` and contributes no LR change in :class:`LRLossCorrelation`.

The detectors live in one module each -- :mod:`detectors.lr_jump`, :mod:`detectors.lr_corr`,
:mod:`detectors.lr_level` -- and this module, the family's home in the registry, re-exports them.
"""

from __future__ import annotations

from .lr_corr import LRLossCorrelation
from .lr_jump import DIRECTIONS, LRJump
from .lr_level import LRLevelInstability

__all__ = ["DIRECTIONS", "LRJump", "LRLevelInstability", "LRLossCorrelation"]
