"""Validation of detector snapshots before any of their numbers reach a kernel.

A kernel trusts its state: a ring position or a bucket count read from ``state`` / ``buf`` is
used as an array index, and Numba does not check bounds, so one out-of-range value in a loaded
snapshot is a segmentation fault on the next update.  :func:`check_snapshot` (behind
:meth:`BankDetector.validate_state_dict`) therefore reads the snapshot's envelope through a
:class:`~detectors.validation.Fields`, converts the arrays with :func:`as_float_array` and hands
them to the detector's ``_check_state`` hook, which states its invariants with a
:class:`StateCheck`; the first violated one raises a ``ValueError`` that names the detector and
the field, in the wording of :func:`detectors.validation.field_error`.

Examples
--------
>>> import numpy as np
>>> c = StateCheck("R", np.array([[0.0, 5.0], [1.0, 3.0]]), np.zeros((4, 2)))
>>> c.integers("pos", c.state[0], 0, 3)
Traceback (most recent call last):
...
ValueError: R.load_state_dict(): 'pos' must be integers in the range [0, 3]; got 5.0 (series 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, NoReturn, Protocol

import numpy as np
from numpy.typing import NDArray

from .validation import Fields, field_error

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

#: version of the detectors' snapshot format
STATE_VERSION = 1


class SnapshotOwner(Protocol):
    """What :func:`check_snapshot` reads of a detector (a :class:`~detectors._base.BankDetector`).

    Its state rows' version and layout history, the hyperparameters that shape the state, the
    fresh arrays its snapshot must match, and its own invariants.
    """

    state_version: ClassVar[int]
    legacy_state_rows: ClassVar[Mapping[int, int]]
    state_hyperparameters: ClassVar[tuple[str, ...]]

    def _init_state(self, n: int) -> FloatArray: ...

    def _init_buf(self, n: int) -> FloatArray: ...

    def _check_state(self, c: StateCheck) -> None: ...

    def _upgrade_rows(self, version: int, state: FloatArray) -> FloatArray: ...


class CheckedState(NamedTuple):
    """A validated snapshot (see :meth:`BankDetector.validate_state_dict`)."""

    n_series: int
    state: FloatArray
    buf: FloatArray
    score: FloatArray
    alarm: BoolArray


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
        series = f" (series {int(idx[-1])})" if vals.ndim >= 1 else ""
        raise field_error(f"{self.owner}.load_state_dict()", field, rule,
                          float(vals[tuple(idx)]), series)

    def integers(self, field: str, vals: FloatArray, lo: float, hi: float = np.inf) -> None:
        """Whole numbers in ``[lo, hi]``."""
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(vals) & (vals == np.floor(vals)) & (vals >= lo) & (vals <= hi))
        if bad.any():
            h = "inf)" if math.isinf(hi) else f"{int(hi)}]"
            self.fail(field, f"integers in the range [{int(lo)}, {h}", vals, bad)

    def finite(self, field: str, vals: FloatArray, lo: float = -np.inf) -> None:
        """Finite numbers ``>= lo``."""
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(vals) & (vals >= lo))
        if bad.any():
            rule = "finite" if np.isinf(lo) else f"finite and >= {lo}"
            self.fail(field, rule, vals, bad)

    def not_nan(self, field: str, vals: FloatArray, lo: float = -np.inf,
                hi: float = np.inf) -> None:
        """Numbers (infinities allowed) in ``[lo, hi]``."""
        with np.errstate(invalid="ignore"):
            bad = ~((vals >= lo) & (vals <= hi))
        if bad.any():
            self.fail(field, f"a number in the range [{lo}, {hi}]", vals, bad)

    def one_of(self, field: str, vals: FloatArray, allowed: tuple[float, ...]) -> None:
        """Codes from ``allowed``."""
        bad = ~np.isin(vals, np.asarray(allowed, dtype=np.float64))
        if bad.any():
            self.fail(field, f"one of {list(allowed)}", vals, bad)

    def ring(self, field: str, pos: FloatArray, count: FloatArray, window: int) -> None:
        """A ring of ``window`` slots: ``count`` in ``[0, window]``, ``pos`` in
        ``[0, window)`` and ``pos == count`` while the ring is not full."""
        self.integers(f"{field} count", count, 0, window)
        self.integers(f"{field} position", pos, 0, window - 1)
        bad = (count < window) & (pos != count)
        if bad.any():
            self.fail(f"{field} position", "the count while the ring is not full", pos, bad)

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


def upgrade_state(det: SnapshotOwner, f: Fields, st: FloatArray) -> FloatArray:
    """``st`` in ``det``'s current row layout: a snapshot of an older ``state_version`` (rows
    appended since) gets the missing rows from a fresh state (the detector's uncalibrated
    values) and is then handed to the detector's ``_upgrade_rows`` (rows whose meaning
    changed); the current version is returned as is.

    Raises ``ValueError`` for a version newer than the class's, one it does not know, or a
    row count that is not the recorded version's.
    """
    cls = type(det)
    sv = f.integer("state_version", f.get("state_version", 1), lo=1)
    if sv > cls.state_version:
        raise ValueError(f"{f.where}: state_version {sv} is newer than this library's "
                         f"{cls.__name__} ({cls.state_version}).")
    if sv == cls.state_version:
        return st
    rows = cls.legacy_state_rows.get(sv)
    if rows is None or st.shape[0] != rows:
        raise ValueError(f"{f.where}: a state_version {sv} snapshot must have "
                         f"{rows if rows is not None else 'known'} state rows; got {st.shape[0]}.")
    fresh = det._init_state(st.shape[1])
    return det._upgrade_rows(sv, np.ascontiguousarray(np.concatenate([st, fresh[rows:]], axis=0)))


def check_snapshot(det: SnapshotOwner, state: Any) -> CheckedState:
    """Check a snapshot against ``det``; return its arrays (copies) or raise ``ValueError``.

    The contract of :meth:`BankDetector.validate_state_dict`: a mapping of the same class and a
    supported version, numeric ``state`` / ``buf`` arrays of ``det``'s shapes, the
    hyperparameters that shape the state equal to ``det``'s, and ``det``'s own invariants
    (``_check_state``).  Nothing of ``det`` changes.
    """
    name = type(det).__name__
    where = f"{name}.load_state_dict()"
    f = Fields(name, state)
    cls = f.get("class", name)
    if cls != name:
        raise ValueError(f"{where}: snapshot is of class {cls!r:.60}.")
    f.version(STATE_VERSION)
    params = f.mapping("params", {})
    st = upgrade_state(det, f, as_float_array(name, "state", f.get("state"), 2))
    n = st.shape[1]
    if "n_series" in params and not same_value(params["n_series"], n):
        raise ValueError(f"{where}: 'params.n_series' is {params['n_series']!r:.60} but the "
                         f"state arrays hold {n} series.")
    # expected shapes from zero-series arrays: a small hostile 'state' must not make us
    # allocate a huge reference buffer
    ref_state = (det._init_state(0).shape[0], n)
    ref_buf = (det._init_buf(0).shape[0], n)
    if "buf" in state:
        buf = as_float_array(name, "buf", state["buf"], None)
        if buf.size == 0 and ref_buf[0] == 0:
            buf = np.zeros(ref_buf)  # (0, n) is [] after a JSON round trip
    elif ref_buf[0] == 0:
        buf = np.zeros(ref_buf)
    else:
        raise ValueError(f"{where}: 'buf' is missing.")
    if st.shape != ref_state or buf.shape != ref_buf:
        raise ValueError(f"{where}: state shapes {st.shape}/{buf.shape} do not match this "
                         f"detector's {ref_state}/{ref_buf}; were the hyperparameters the same?")
    for h in det.state_hyperparameters:
        if h in params and not same_value(params[h], getattr(det, h)):
            raise ValueError(f"{where}: hyperparameters that shape the state do not match: "
                             f"{h}={params[h]!r:.60} in the snapshot, {getattr(det, h)!r} here.")
    det._check_state(StateCheck(name, st, buf))
    score = np.full(n, np.nan)
    alarm = np.zeros(n, dtype=np.bool_)
    if "score" in state:
        score = as_float_array(name, "score", state["score"], 1)
        flags = as_float_array(name, "alarm", state.get("alarm", alarm), 1)
        if score.shape != (n,) or flags.shape != (n,):
            raise ValueError(f"{where}: 'score'/'alarm' have shapes {score.shape}/"
                             f"{flags.shape}; expected ({n},).")
        alarm = flags != 0.0
    return CheckedState(n, st, buf, score, alarm)
