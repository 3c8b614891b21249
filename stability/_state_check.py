"""Typed reads of a state dict, with errors that name the field.

Every ``load_state_dict`` of the runtime reads its snapshot through a :class:`Fields`: each
read checks the type and range of one leaf and raises ``ValueError`` naming the owner and the
key path (``"Policy.load_state_dict(): 'lr[1]' must be a float in (0.0, 1.0]; got nan."``).
The loaders read *everything* first and assign only afterwards, so a rejected snapshot leaves
the object as it was.

Absent keys take their defaults (fields added in later versions); unknown keys are ignored.

Examples
--------
>>> f = Fields("Policy", {"version": 2, "level": 1, "lr": [10, 0.5, 100, 50]})
>>> f.integer("level", lo=0), f.integer("n_merged", f.get("n_merged", 0))
(1, 0)
>>> f.number("lr[1]", f.seq("lr", 4)[1], lo=0.0, hi=1.0, low_open=True)
0.5
>>> Fields("Policy", {"level": -1}).integer("level", lo=0)
Traceback (most recent call last):
...
ValueError: Policy.load_state_dict(): 'level' must be an int in [0, 4611686018427387904]; got -1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

#: bound on step numbers and counters read from a snapshot (the monitor's Numba paths use int64)
STEP_MAX = 2**62

_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
              "infinity": math.inf, "-infinity": -math.inf}

_REQUIRED = object()


class Fields:
    """Checked reads from one mapping of a snapshot.

    Parameters
    ----------
    owner
        Class name used in error messages.
    sd
        The mapping (anything else raises ``ValueError``).
    path
        Key path of ``sd`` inside the whole snapshot (``"guard."``), for messages.
    """

    def __init__(self, owner: str, sd: Any, path: str = "") -> None:
        self.owner = owner
        self.path = path
        if not isinstance(sd, Mapping):
            where = f"'{path.rstrip('.')}'" if path else "the snapshot"
            raise ValueError(f"{owner}.load_state_dict(): {where} must be a mapping; "
                             f"got {type(sd).__name__}.")
        self.sd = sd

    def fail(self, key: str, what: str, value: Any) -> NoReturn:
        """Raise the ``ValueError`` for one field."""
        r = repr(value)
        if len(r) > 80:
            r = r[:77] + "..."
        raise ValueError(f"{self.owner}.load_state_dict(): '{self.path}{key}' must be {what}; "
                         f"got {r}.")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value (``default`` if absent; required without one)."""
        if key in self.sd:
            return self.sd[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.owner}.load_state_dict(): '{self.path}{key}' is missing.")
        return default

    # ------------------------------------------------------------------ leaves
    def version(self, current: int, key: str = "version", default: int | None = None) -> int:
        """The snapshot's format version, at most ``current``."""
        v = self.get(key, current if default is None else default)
        if isinstance(v, int) and not isinstance(v, bool) and v > current:
            raise ValueError(f"{self.owner}.load_state_dict(): state version {v} is newer than "
                             f"this library's ({current}).")
        return self.integer(key, v, lo=0, hi=current, what="a supported version (an int in")

    def integer(self, key: str, value: Any = _REQUIRED, *, lo: int = -STEP_MAX,
                hi: int = STEP_MAX, what: str = "an int in") -> int:
        """An int (``bool`` excluded; integral floats accepted) in ``[lo, hi]``.

        ``value`` is read from ``key`` unless given; when given it is only checked (``key``
        then only names it), e.g. ``f.integer("lr[0]", lr[0])``.
        """
        v = self.get(key) if value is _REQUIRED else value
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            if hasattr(v, "__index__") and not isinstance(v, bool):
                try:
                    iv = v.__index__()
                except Exception:  # foreign objects may raise anything
                    iv = None
                if iv is not None and lo <= iv <= hi:
                    return int(iv)
            self.fail(key, f"{what} [{lo}, {hi}]", v)
        return int(v)

    def opt_integer(self, key: str, value: Any = _REQUIRED, **kw: Any) -> int | None:
        """``None`` or an int (see :meth:`integer`); absent means ``None``."""
        v = self.get(key, None) if value is _REQUIRED else value
        return None if v is None else self.integer(key, v, **kw)

    def number(self, key: str, value: Any = _REQUIRED, *, lo: float = -math.inf,
              hi: float = math.inf, low_open: bool = False, nan: bool = False,
              inf: bool = False) -> float:
        """A float in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``); NaN only with ``nan``,
        +-inf only with ``inf``.  Non-finite values may be written as strings
        (``"nan"``, ``"inf"``, as the runtime's JSON-safe snapshots do)."""
        v = self.get(key) if value is _REQUIRED else value
        x: float | None = None
        if isinstance(v, str):
            x = _NONFINITE.get(v.strip().lower())
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                x = float(v)
            except OverflowError:
                x = None
        elif hasattr(v, "dtype") and getattr(v, "shape", None) == () and \
                getattr(v.dtype, "kind", "") in "iuf":
            x = float(v)
        ok = x is not None
        if x is not None:
            if math.isnan(x):
                ok = nan
            elif math.isinf(x) and not inf:
                ok = False
            else:
                ok = (x > lo if low_open else x >= lo) and x <= hi
        if not ok or x is None:
            rng = f" in {'(' if low_open else '['}{lo}, {hi}]" if (lo, hi) != (
                -math.inf, math.inf) else ""
            kind = "a float" if inf else "a finite float"
            self.fail(key, f"{kind}{rng}" + (" or nan" if nan else ""), v)
        return x

    def opt_number(self, key: str, value: Any = _REQUIRED, **kw: Any) -> float | None:
        """``None`` or a float (see :meth:`number`); absent means ``None``."""
        v = self.get(key, None) if value is _REQUIRED else value
        return None if v is None else self.number(key, v, **kw)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        """A bool (``0``/``1`` accepted)."""
        v = self.get(key, default)
        if isinstance(v, bool) or (type(v) is int and v in (0, 1)):
            return bool(v)
        if type(v).__name__ == "bool_":  # numpy.bool_ without importing numpy here
            return bool(v)
        self.fail(key, "a bool", v)

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

    def at(self, key: str) -> str:
        """The full key path of ``key``, for callers composing their own messages."""
        return f"{self.path}{key}"
