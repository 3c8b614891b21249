"""The defaults of the tuner's limits (:class:`replay.tuning.Tuner`), importable without NumPy or
Numba so that the command line can show them cheaply; :mod:`replay.tuning` re-exports them.

Why these values: docs/guides/tuning.md, "Limits".
"""

from __future__ import annotations

__all__ = ["DEFAULT_HOLD_BACK", "DEFAULT_MAX_CLEAN_ALARMED", "DEFAULT_MIN_GAIN"]

#: the fraction of the clean runs with any alarm episode a tuned config may reach (issue 28's
#: target: quiet on at least 99 % of healthy runs; below 100 clean runs that means on all)
DEFAULT_MAX_CLEAN_ALARMED = 0.01
#: the fewest additional labelled faults a move must detect (1 = any gain in recall; a move
#: that catches one more fault is fitted to that one fault's score)
DEFAULT_MIN_GAIN = 2
#: the fraction of the clean runs held back from tuning; every move must keep both limits on
#: them too (:func:`replay.tuning.hold_back`)
DEFAULT_HOLD_BACK = 0.5
