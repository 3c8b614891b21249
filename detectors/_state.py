"""Validation of detector snapshots before any of their numbers reach a kernel.

A kernel trusts its state: a ring position or a bucket count read from ``state`` / ``buf`` is
used as an array index, and Numba does not check bounds, so one out-of-range value in a loaded
snapshot is a segmentation fault on the next update.  :meth:`BankDetector.load_state_dict`
therefore converts the arrays with :func:`as_float_array` and hands them to the detector's
``_check_state`` hook, which states its invariants with a :class:`StateCheck`; the first
violated one raises a ``ValueError`` that names the detector and the field.

Examples
--------
>>> import numpy as np
>>> c = StateCheck("R", np.array([[0.0, 5.0], [1.0, 3.0]]), np.zeros((4, 2)))
>>> c.integers("pos", c.state[0], 0, 3)
Traceback (most recent call last):
...
ValueError: R.load_state_dict(): state field 'pos' must hold integers in [0, 3]; got 5.0 (series 1).
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]


def as_float_array(owner: str, field: str, value: Any, ndim: int | None) -> FloatArray:
    """A C-contiguous float64 *copy* of ``value`` (array or nested lists) with ``ndim`` dims.

    Raises ``ValueError`` naming ``field`` for ragged lists, strings, objects, complex numbers
    or the wrong number of dimensions (``ndim=None``: any).
    """
    try:
        a = np.array(value, copy=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"{owner}.load_state_dict(): '{field}' is not a numeric array ({exc})."
        ) from None
    if a.dtype.kind not in "biuf":
        raise ValueError(
            f"{owner}.load_state_dict(): '{field}' must be a numeric array; got dtype {a.dtype}."
        )
    if ndim is not None and a.ndim != ndim:
        raise ValueError(
            f"{owner}.load_state_dict(): '{field}' must have {ndim} dimension(s); "
            f"got shape {a.shape}."
        )
    return np.ascontiguousarray(a, dtype=np.float64)


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` for hyperparameter values, lists and tuples alike (JSON turns one into the
    other); anything that cannot be compared is different."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
            return False
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) != isinstance(b, str):
        return False
    try:
        return bool(a == b)
    except Exception:  # foreign objects may raise anything
        return False


class StateCheck:
    """The invariants of one snapshot's ``state`` (rows = fields) and ``buf`` arrays.

    Each method raises ``ValueError`` naming the detector and the field when an element
    breaks the rule; ``vals`` is a row (or block) of :attr:`state` or :attr:`buf`.
    """

    def __init__(self, owner: str, state: FloatArray, buf: FloatArray) -> None:
        self.owner = owner
        self.state = state
        self.buf = buf

    def fail(self, field: str, rule: str, vals: FloatArray, bad: NDArray[np.bool_]) -> NoReturn:
        """Raise for the first element of ``vals`` flagged in ``bad``."""
        idx = np.argwhere(bad)[0]
        where = f" (series {int(idx[-1])})" if vals.ndim >= 1 else ""
        raise ValueError(
            f"{self.owner}.load_state_dict(): state field '{field}' must {rule}; "
            f"got {float(vals[tuple(idx)])!r}{where}."
        )

    def integers(self, field: str, vals: FloatArray, lo: float, hi: float = np.inf) -> None:
        """Whole numbers in ``[lo, hi]``."""
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(vals) & (vals == np.floor(vals)) & (vals >= lo) & (vals <= hi))
        if bad.any():
            h = "inf)" if math.isinf(hi) else f"{int(hi)}]"
            self.fail(field, f"hold integers in [{int(lo)}, {h}", vals, bad)

    def finite(self, field: str, vals: FloatArray, lo: float = -np.inf) -> None:
        """Finite numbers ``>= lo``."""
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(vals) & (vals >= lo))
        if bad.any():
            rule = "be finite" if np.isinf(lo) else f"be finite and >= {lo}"
            self.fail(field, rule, vals, bad)

    def not_nan(self, field: str, vals: FloatArray, lo: float = -np.inf,
                hi: float = np.inf) -> None:
        """Numbers (infinities allowed) in ``[lo, hi]``."""
        with np.errstate(invalid="ignore"):
            bad = ~((vals >= lo) & (vals <= hi))
        if bad.any():
            self.fail(field, f"be a number in [{lo}, {hi}]", vals, bad)

    def one_of(self, field: str, vals: FloatArray, allowed: tuple[float, ...]) -> None:
        """Codes from ``allowed``."""
        bad = ~np.isin(vals, np.asarray(allowed, dtype=np.float64))
        if bad.any():
            self.fail(field, f"be one of {list(allowed)}", vals, bad)

    def ring(self, field: str, pos: FloatArray, count: FloatArray, window: int) -> None:
        """A ring of ``window`` slots: ``count`` in ``[0, window]``, ``pos`` in
        ``[0, window)`` and ``pos == count`` while the ring is not full."""
        self.integers(f"{field} count", count, 0, window)
        self.integers(f"{field} position", pos, 0, window - 1)
        bad = (count < window) & (pos != count)
        if bad.any():
            self.fail(f"{field} position", "equal the count while the ring is not full", pos, bad)

    def sorted_copy(self, field: str, ring: FloatArray, srt: FloatArray, count: FloatArray,
                    window: int) -> None:
        """``srt[:n, i]`` is ``ring``'s ``n = min(count, window)`` valid values in order."""
        for i in range(ring.shape[1]):
            n = int(min(count[i], window))
            if not np.array_equal(np.sort(ring[:n, i]), srt[:n, i]):
                raise ValueError(
                    f"{self.owner}.load_state_dict(): '{field}' of series {i} is not the sorted "
                    "copy of its window."
                )
