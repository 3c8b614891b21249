"""What every bank kernel shares: parameter layouts and the per-value prologue.

Parameter layouts
-----------------
Each detector declares the order of its float64 ``params`` array once, as a ``NamedTuple``
whose first two fields are ``threshold`` and ``freeze_on_alarm``::

    class EWMAParams(NamedTuple):
        threshold: float
        freeze_on_alarm: float
        alpha: float
        ...

    P = indices(EWMAParams)          # EWMAParams(threshold=0, freeze_on_alarm=1, alpha=2, ...)

The class is :attr:`BankDetector.param_layout` (it builds the array from the detector's
attributes, by name) and the kernel reads ``params[P.alpha]``: Numba freezes the global
named tuple, so the index is a compile-time constant, exactly as a literal ``params[2]``.

Prologue
--------
:func:`skip_value` is the missing / non-finite handling of the kernel contract
(``detectors/_base.py``): a missing value scores ``nan`` without an alarm, a non-finite one
``+inf`` with an alarm, and neither enters the state (:func:`skip_pair`: the same for a
detector that needs both of its two inputs on every step).  :func:`learns` is the
freeze-on-alarm rule.  All are ``inline="always"``: inlined into the kernel's own IR, they
compile to the same code as the hand-written copies they replace.  Kernels whose inputs may
be missing independently (``TrainValDivergence``, ``OverfitGap``, ``ActivationShift``) and
``NonFiniteGuard`` (which scores non-finite values) keep their own handling.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from numba import njit

#: index of the threshold and of the freeze-on-alarm flag in every ``params`` array
THRESHOLD, FREEZE = 0, 1
#: the fields every parameter layout starts with
COMMON_FIELDS = ("threshold", "freeze_on_alarm")

T = TypeVar("T")


def indices(layout: type[T]) -> T:
    """The layout's field positions as an instance of the layout (``indices(L).alpha == 2``).

    Raises
    ------
    TypeError
        If ``layout`` is not a named tuple starting with ``threshold, freeze_on_alarm``.
    """
    fields: Any = getattr(layout, "_fields", None)
    if not isinstance(fields, tuple) or fields[:2] != COMMON_FIELDS:
        raise TypeError(
            f"{getattr(layout, '__name__', layout)!r} must be a NamedTuple whose first fields "
            f"are {COMMON_FIELDS}."
        )
    return layout(*range(len(fields)))


@njit(cache=True, error_model="numpy", inline="always")
def skip_value(missing, x, scores, alarms, t, i):  # type: ignore[no-untyped-def]
    """Write step ``t`` of series ``i`` for a missing or non-finite ``x``; ``True`` if it was.

    A missing value scores ``nan`` without an alarm, a non-finite one ``+inf`` with an alarm.
    The caller skips the value (``continue``) when this returns ``True``: neither enters the
    state.
    """
    if missing:
        scores[t, i] = np.nan
        alarms[t, i] = False
        return True
    if not np.isfinite(x):
        scores[t, i] = np.inf
        alarms[t, i] = True
        return True
    return False


@njit(cache=True, error_model="numpy", inline="always")
def learns(alarm, freeze):  # type: ignore[no-untyped-def]
    """Whether a series updates its statistics: not while in alarm with ``freeze_on_alarm``."""
    return not (alarm and freeze)


@njit(cache=True, error_model="numpy", inline="always")
def skip_pair(missing0, missing1, x0, x1, scores, alarms, t, i):  # type: ignore[no-untyped-def]
    """:func:`skip_value` for a detector that needs both of its two inputs on every step."""
    if missing0 or missing1:
        scores[t, i] = np.nan
        alarms[t, i] = False
        return True
    if not (np.isfinite(x0) and np.isfinite(x1)):
        scores[t, i] = np.inf
        alarms[t, i] = True
        return True
    return False
