"""Pure functions behind the policy's persistent controls: the LR-cut ramp and the adaptive clip.

Everything here is a function of its arguments only, so the policy's persistent control values on
a step without alarms are a pure function of (policy state, step) -- the property that lets the
batch replay call the policy only on alarm steps.
"""

from __future__ import annotations

import math

from detectors.validation import choice_rule, param_error

RAMP_SHAPES = ("linear", "cosine", "step")


def lr_factor_at(
    step: int,
    start: int,
    factor: float,
    duration: int,
    restore_steps: int,
    shape: str = "linear",
) -> float:
    """LR multiplier at ``step`` for a cut of ``factor`` made at ``start``.

    The cut holds ``factor`` for ``duration`` steps (``start .. start + duration - 1``), then ramps
    back to 1.0 over ``restore_steps`` steps, reaching exactly 1.0 on step
    ``start + duration + restore_steps - 1``.  Steps before ``start`` are untouched (1.0).

    Parameters
    ----------
    step, start : int
        The step asked about and the step the cut was made.
    factor : float
        Multiplier during the cut, in ``(0, 1]``.
    duration, restore_steps : int
        Length of the flat part and of the ramp (``>= 0``).
    shape : {"linear", "cosine", "step"}
        Shape of the ramp; ``"step"`` jumps back to 1.0 at the end of the ramp.

    Examples
    --------
    >>> [lr_factor_at(s, 10, 0.5, 2, 4) for s in range(9, 17)]
    [1.0, 0.5, 0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    >>> lr_factor_at(13, 10, 0.5, 2, 4, "cosine")
    0.75
    """
    t = step - start
    if t < 0:
        return 1.0
    if t < duration:
        return factor
    t -= duration
    if t >= restore_steps - 1:
        return 1.0
    frac = (t + 1) / restore_steps
    if shape == "linear":
        w = frac
    elif shape == "cosine":
        w = 0.5 - 0.5 * math.cos(math.pi * frac)
    elif shape == "step":
        return factor
    else:
        raise param_error("lr_factor_at", "shape", choice_rule(RAMP_SHAPES), shape)
    return factor + (1.0 - factor) * w


def lr_cut_end(start: int, duration: int, restore_steps: int) -> int:
    """First step at which a cut made at ``start`` is fully restored (factor 1.0).

    >>> lr_cut_end(10, 2, 4)
    15
    >>> lr_factor_at(14, 10, 0.5, 2, 4), lr_factor_at(15, 10, 0.5, 2, 4)
    (0.875, 1.0)
    """
    return start + duration + max(restore_steps - 1, 0)


def compound_factor(current: float, factor: float, min_factor: float) -> float:
    """Factor of a new cut made while ``current`` is in effect: ``current * factor``, floored.

    >>> [compound_factor(c, 0.5, 0.1) for c in (1.0, 0.5, 0.2)]
    [0.5, 0.25, 0.1]
    """
    return max(min_factor, min(1.0, current) * factor)


def adaptive_clip(
    median: float | None,
    factor: float,
    current: float | None,
    *,
    tighten: float = 0.5,
    min_norm: float = 0.0,
    max_norm: float | None = None,
) -> float | None:
    """Tighter gradient-clipping norm derived from recent gradient-norm statistics.

    ``factor * median`` when a finite positive ``median`` of the recent gradient norms is known,
    otherwise ``tighten * current``; never above ``current`` (the clip in force) nor ``max_norm``
    (a configured cap), never below ``min_norm``.  ``None`` when nothing is known to derive it from.

    Examples
    --------
    >>> adaptive_clip(0.8, 2.0, None)
    1.6
    >>> adaptive_clip(0.8, 2.0, 1.0)          # never above the clip in force
    1.0
    >>> adaptive_clip(None, 2.0, 1.0)         # no statistics: tighten the current clip
    0.5
    >>> adaptive_clip(None, 2.0, None) is None
    True
    """
    cand: float | None = None
    if median is not None and math.isfinite(median) and median > 0.0:
        cand = factor * float(median)
    elif current is not None and math.isfinite(current):
        cand = tighten * float(current)
    elif max_norm is not None:
        cand = float(max_norm)
    if cand is None:
        return None
    for cap in (current, max_norm):
        if cap is not None and math.isfinite(cap):
            cand = min(cand, float(cap))
    return max(cand, min_norm)
