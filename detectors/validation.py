"""Typed, range-checked reads of parameters and snapshots: the project's one validation dialect.

Every check here does three things the same way everywhere: it decides what counts as a value of
the type (``bool`` is never a number, NumPy scalars are, a NaN is only where allowed), checks the
range, and names the owner, the field and the bad value when it fails.  Two renderings share the
rule text:

* constructor arguments, scikit-learn style (:func:`param_error`)::

      The 'alpha' parameter of EWMAZScore must be a float in the range (0.0, 1.0]. Got 0.0 instead.

* values read from data -- a snapshot's fields, a detector's state arrays (:func:`field_error`)::

      Policy.load_state_dict(): 'lr[1]' must be a finite float in the range (0.0, 1.0]; got nan.

The readers: :func:`check_int` / :func:`check_float` / :func:`check_bool` for constructor
arguments, :class:`Fields` for snapshot mappings (``detectors``' own snapshots and every runtime
object of ``stability``), and the predicates :func:`as_int` / :func:`as_float` / :func:`as_bool`
underneath them (``None`` = not acceptable), which config parsers use with their own key paths.
NumPy only: this module sits at the bottom of the layers.

Examples
--------
>>> check_float("EWMA", "alpha", 0.0, 0.0, 1.0, low_open=True)
Traceback (most recent call last):
...
ValueError: The 'alpha' parameter of EWMA must be a float in the range (0.0, 1.0]. Got 0.0 instead.
>>> f = Fields("Pol", {"lr": [10, float("nan")]})
>>> f.number("lr[1]", f.seq("lr")[1], lo=0.0, hi=1.0)
Traceback (most recent call last):
...
ValueError: Pol.load_state_dict(): 'lr[1]' must be a finite float in the range [0.0, 1.0]; got nan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

__all__ = ["STEP_MAX", "Fields", "as_bool", "as_float", "as_int", "check_bool", "check_choice",
           "check_float", "check_int", "check_opt_float", "choice_rule", "field_error",
           "float_rule", "int_rule", "param_error", "short_repr"]

#: bound on step numbers and counters read from a snapshot (the monitor's Numba paths use int64)
STEP_MAX = 2**62

_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "-infinity": -math.inf}

_REQUIRED: Any = object()


# ---------------------------------------------------------------------------- acceptance
def as_int(value: Any, lo: float = -math.inf, hi: float = math.inf, *,
           integral_floats: bool = False) -> int | None:
    """``value`` as an int in ``[lo, hi]``, or ``None``.

    Python and NumPy integers are ints, ``bool`` is not; an integral float (``3.0``) only with
    ``integral_floats`` (snapshots may hold them, constructor arguments may not).

    >>> as_int(3), as_int(True), as_int(3.0), as_int(3.0, integral_floats=True), as_int(-1, 0)
    (3, None, None, 3, None)
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if integral_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (int, np.integer)):
        v = int(value)
    elif hasattr(value, "__index__") and not isinstance(value, (float, np.floating)):
        try:
            v = int(value.__index__())
        except Exception:  # foreign objects may raise anything
            return None
    else:
        return None
    return v if lo <= v <= hi else None


def as_float(value: Any, lo: float = -math.inf, hi: float = math.inf, *, low_open: bool = False,
             high_open: bool = False, finite: bool = False, nan: bool = False,
             text: bool = False) -> float | None:
    """``value`` as a float in the range, or ``None``.

    Python and NumPy numbers (also 0-d arrays) count, ``bool`` does not.  NaN only with ``nan``;
    ``+-inf`` never with ``finite``, else where the range reaches it; with ``text`` the strings
    ``"nan"``, ``"inf"``, ``"-inf"`` (JSON-safe snapshots write non-finite values so).

    >>> as_float(0.5, 0.0, 1.0), as_float(True), as_float("nan", nan=True, text=True)
    (0.5, None, nan)
    >>> as_float(float("inf")), as_float(float("inf"), finite=True)
    (inf, None)
    """
    x: float | None = None
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, str):
        x = _NONFINITE.get(value.strip().lower()) if text else None
    elif isinstance(value, (int, float, np.integer, np.floating)):
        try:
            x = float(value)
        except OverflowError:
            return None
    elif isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iuf":
        x = float(value)
    if x is None:
        return None
    if math.isnan(x):
        return x if nan else None
    if finite and math.isinf(x):
        return None
    ok = (x > lo if low_open else x >= lo) and (x < hi if high_open else x <= hi)
    return x if ok else None


def as_bool(value: Any, *, ints: bool = False) -> bool | None:
    """``value`` as a bool (NumPy's too; ``0`` / ``1`` only with ``ints``), or ``None``.

    >>> as_bool(True), as_bool(1), as_bool(1, ints=True), as_bool("true")
    (True, None, True, None)
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if ints and type(value) is int and value in (0, 1):
        return bool(value)
    return None


# ---------------------------------------------------------------------------- rule text
def _end(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else repr(x)


def int_rule(lo: float = -math.inf, hi: float = math.inf) -> str:
    """``"an int in the range [0, inf)"``.

    >>> int_rule(2), int_rule(0, 62), int_rule()
    ('an int in the range [2, inf)', 'an int in the range [0, 62]', 'an int')
    """
    if math.isinf(lo) and math.isinf(hi):
        return "an int"
    lb = "(" if math.isinf(lo) else "["
    hb = ")" if math.isinf(hi) else "]"
    lo_s = _end(lo) if math.isinf(lo) else str(int(lo))
    hi_s = _end(hi) if math.isinf(hi) else str(int(hi))
    return f"an int in the range {lb}{lo_s}, {hi_s}{hb}"


def float_rule(lo: float = -math.inf, hi: float = math.inf, *, low_open: bool = False,
               high_open: bool = False, finite: bool = False, nan: bool = False) -> str:
    """``"a float in the range (0.0, 1.0]"``; an infinite end is closed when it is accepted.

    >>> float_rule(0.0, 1.0, low_open=True), float_rule(0.0, finite=True), float_rule(nan=True)
    ('a float in the range (0.0, 1.0]', 'a finite float in the range [0.0, inf)', 'a float or nan')
    """
    kind = "a finite float" if finite else "a float"
    if not (math.isinf(lo) and math.isinf(hi)):
        lb = "(" if low_open or (finite and math.isinf(lo)) else "["
        hb = ")" if high_open or (finite and math.isinf(hi)) else "]"
        kind += f" in the range {lb}{_end(float(lo))}, {_end(float(hi))}{hb}"
    return kind + (" or nan" if nan else "")


def choice_rule(choices: Any) -> str:
    """``"one of ['down', 'up']"`` (sorted).

    >>> choice_rule({"up": 1, "down": -1})
    "one of ['down', 'up']"
    """
    return f"one of {sorted(choices, key=str)}"


# ---------------------------------------------------------------------------- messages
def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile snapshot may hold anything)."""
    try:
        r = repr(value)
    except Exception:  # foreign objects may raise anything
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def param_error(owner: str, name: str, rule: str, value: Any) -> ValueError:
    """The error for a bad constructor argument (scikit-learn's wording)."""
    return ValueError(f"The '{name}' parameter of {owner} must be {rule}. "
                      f"Got {short_repr(value)} instead.")


def field_error(where: str, field: str, rule: str, value: Any, detail: str = "") -> ValueError:
    """The error for a bad value read from data: ``"{where}: '{field}' must be {rule}; got
    {value}{detail}."`` (``where`` names the owner, e.g. ``"Policy.load_state_dict()"``)."""
    return ValueError(f"{where}: '{field}' must be {rule}; got {short_repr(value)}{detail}.")


# ---------------------------------------------------------------------------- constructor args
def check_int(owner: str, name: str, value: Any, low: float, high: float = math.inf) -> int:
    """Validate an integer hyperparameter, scikit-learn style.

    >>> check_int("EWMA", "warmup", 3, 0)
    3
    >>> check_int("EWMA", "warmup", -1, 0)
    Traceback (most recent call last):
    ...
    ValueError: The 'warmup' parameter of EWMA must be an int in the range [0, inf). Got -1 instead.
    """
    v = as_int(value, low, high)
    if v is None:
        raise param_error(owner, name, int_rule(low, high), value)
    return v


def check_float(owner: str, name: str, value: Any, low: float = -math.inf,
                high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False) -> float:
    """Validate a float hyperparameter (NaN never; ``+-inf`` where the range reaches it).

    >>> check_float("EWMAZScore", "alpha", 0.5, 0.0, 1.0, low_open=True)
    0.5
    """
    v = as_float(value, low, high, low_open=low_open, high_open=high_open)
    if v is None:
        raise param_error(owner, name, float_rule(low, high, low_open=low_open,
                                                  high_open=high_open), value)
    return v


def check_opt_float(owner: str, name: str, value: Any, low: float = -math.inf,
                    high: float = math.inf, *, low_open: bool = False,
                    high_open: bool = False) -> float | None:
    """Validate an optional float hyperparameter: ``None`` or as :func:`check_float`.

    >>> check_opt_float("Watchdog", "peak_flops", None, 0.0, low_open=True) is None
    True
    >>> check_opt_float("Watchdog", "peak_flops", 0.0, 0.0, low_open=True)
    Traceback (most recent call last):
    ...
    ValueError: The 'peak_flops' parameter of Watchdog must be a float in the range (0.0, inf] \
or None. Got 0.0 instead.
    """
    if value is None:
        return None
    v = as_float(value, low, high, low_open=low_open, high_open=high_open)
    if v is None:
        raise param_error(owner, name, float_rule(low, high, low_open=low_open,
                                                  high_open=high_open) + " or None", value)
    return v


def check_choice(owner: str, name: str, value: Any, choices: Any) -> Any:
    """Validate a hyperparameter that takes one of ``choices`` (returned unchanged).

    >>> check_choice("CUSUM", "direction", "up", ("up", "down"))
    'up'
    >>> check_choice("CUSUM", "direction", "sideways", ("up", "down"))
    Traceback (most recent call last):
    ...
    ValueError: The 'direction' parameter of CUSUM must be one of ['down', 'up']. Got \
'sideways' instead.
    """
    try:
        ok = value in choices
    except (TypeError, ValueError):  # unhashable (against a dict), an array (ambiguous)
        ok = False
    if not ok:
        raise param_error(owner, name, choice_rule(choices), value)
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Validate a boolean hyperparameter.

    >>> check_bool("EWMAZScore", "freeze_on_alarm", True)
    True
    """
    v = as_bool(value)
    if v is None:
        raise param_error(owner, name, "a bool", value)
    return v


# ---------------------------------------------------------------------------- snapshots
class Fields:
    """Checked reads from one mapping of a snapshot; errors name the owner and the key path.

    Each ``load_state_dict`` reads *everything* first and assigns only afterwards, so a rejected
    snapshot leaves the object as it was.  Absent keys take their defaults (fields added in later
    versions); unknown keys are ignored.

    Parameters
    ----------
    owner
        Class name used in error messages (``"Policy"`` -> ``"Policy.load_state_dict(): ..."``).
    sd
        The mapping (anything else raises ``ValueError``).
    path
        Key path of ``sd`` inside the whole snapshot (``"guard."``), for messages.

    Examples
    --------
    >>> f = Fields("Policy", {"version": 2, "level": 1, "lr": [10, 0.5, 100, 50]})
    >>> f.integer("level", lo=0), f.integer("n_merged", f.get("n_merged", 0))
    (1, 0)
    >>> f.number("lr[1]", f.seq("lr", 4)[1], lo=0.0, hi=1.0, low_open=True)
    0.5
    >>> Fields("Policy", {"level": -1}).integer("level", lo=0, hi=9)
    Traceback (most recent call last):
    ...
    ValueError: Policy.load_state_dict(): 'level' must be an int in the range [0, 9]; got -1.
    """

    def __init__(self, owner: str, sd: Any, path: str = "") -> None:
        self.owner = owner
        self.path = path
        self.where = f"{owner}.load_state_dict()"
        if not isinstance(sd, Mapping):
            what = f"'{path.rstrip('.')}'" if path else "the snapshot"
            raise ValueError(f"{self.where}: {what} must be a mapping; got {type(sd).__name__}.")
        self.sd = sd

    def fail(self, key: str, what: str, value: Any, detail: str = "") -> NoReturn:
        """Raise the ``ValueError`` for one field (``what``: the rule it breaks)."""
        raise field_error(self.where, self.at(key), what, value, detail)

    def at(self, key: str) -> str:
        """The full key path of ``key``, for callers composing their own messages."""
        return f"{self.path}{key}"

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value (``default`` if absent; required without one)."""
        if key in self.sd:
            return self.sd[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.where}: '{self.at(key)}' is missing.")
        return default

    # ------------------------------------------------------------------ leaves
    def version(self, current: int, key: str = "version", default: int | None = None) -> int:
        """The snapshot's format version, at most ``current``."""
        v = self.get(key, current if default is None else default)
        if isinstance(v, int) and not isinstance(v, bool) and v > current:
            raise ValueError(f"{self.where}: state version {v} is newer than this library's "
                             f"({current}).")
        return self.integer(key, v, lo=0, hi=current)

    def integer(self, key: str, value: Any = _REQUIRED, *, lo: int = -STEP_MAX,
                hi: int = STEP_MAX) -> int:
        """An int (``bool`` excluded; integral floats accepted) in ``[lo, hi]``.

        ``value`` is read from ``key`` unless given; when given it is only checked (``key``
        then only names it), e.g. ``f.integer("lr[0]", lr[0])``.
        """
        v = self.get(key) if value is _REQUIRED else value
        out = as_int(v, lo, hi, integral_floats=True)
        if out is None:
            self.fail(key, int_rule(lo, hi), v)
        return out

    def opt_integer(self, key: str, value: Any = _REQUIRED, **kw: Any) -> int | None:
        """``None`` or an int (see :meth:`integer`); absent means ``None``."""
        v = self.get(key, None) if value is _REQUIRED else value
        return None if v is None else self.integer(key, v, **kw)

    def number(self, key: str, value: Any = _REQUIRED, *, lo: float = -math.inf,
               hi: float = math.inf, low_open: bool = False, high_open: bool = False,
               nan: bool = False, inf: bool = False) -> float:
        """A float in the range; NaN only with ``nan``, +-inf only with ``inf``.  Non-finite
        values may be written as strings (``"nan"``, ``"inf"``, as the runtime's JSON-safe
        snapshots do)."""
        v = self.get(key) if value is _REQUIRED else value
        kw: dict[str, Any] = {"low_open": low_open, "high_open": high_open, "finite": not inf,
                              "nan": nan}
        x = as_float(v, lo, hi, text=True, **kw)
        if x is None:
            self.fail(key, float_rule(lo, hi, **kw), v)
        return x

    def opt_number(self, key: str, value: Any = _REQUIRED, **kw: Any) -> float | None:
        """``None`` or a float (see :meth:`number`); absent means ``None``."""
        v = self.get(key, None) if value is _REQUIRED else value
        return None if v is None else self.number(key, v, **kw)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        """A bool (``0``/``1`` accepted)."""
        v = self.get(key, default)
        out = as_bool(v, ints=True)
        if out is None:
            self.fail(key, "a bool", v)
        return out

    def text(self, key: str, default: Any = _REQUIRED, *, value: Any = _REQUIRED,
             max_len: int = 10_000) -> str:
        """A string of at most ``max_len`` characters (``value`` given: only checked)."""
        v = self.get(key, default) if value is _REQUIRED else value
        if not isinstance(v, str) or len(v) > max_len:
            self.fail(key, f"a string of at most {max_len} characters", v)
        return v

    def seq(self, key: str, length: int | None = None, value: Any = _REQUIRED,
            *, max_len: int = 10_000_000) -> list[Any]:
        """A list or tuple (of ``length`` items when given)."""
        v = self.get(key) if value is _REQUIRED else value
        if not isinstance(v, (list, tuple)) or (length is not None and len(v) != length) or \
                len(v) > max_len:
            self.fail(key, "a list" + (f" of {length} items" if length is not None else ""), v)
        return list(v)

    def opt_seq(self, key: str, length: int | None = None) -> list[Any] | None:
        """``None`` (also when absent) or a list (see :meth:`seq`)."""
        v = self.get(key, None)
        return None if v is None else self.seq(key, length, v)

    def sub(self, key: str, default: Any = _REQUIRED) -> Fields:
        """The nested mapping at ``key`` (``{}`` when absent and ``default`` is ``{}``)."""
        v = self.get(key, default)
        if v is None and default is not _REQUIRED:
            v = {}
        return Fields(self.owner, v, f"{self.path}{key}.")

    def mapping(self, key: str, default: Any = _REQUIRED) -> Mapping[Any, Any]:
        """The raw nested mapping at ``key`` (``None`` and absent give ``{}`` when a default
        is given)."""
        return self.sub(key, default).sd
