"""Input checks of :class:`replay.recorder.RunRecorder`: steps, metric names and values.

Split out of ``replay/recorder.py`` (pure move). :class:`InputChecksMixin` counts and warns about
skipped input (``RunRecorder.skipped``); the helpers validate steps and parameters and shorten
text for messages.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from replay.schema import STEP

__all__ = ["RESERVED_NAMES", "InputChecksMixin"]

#: metric names the recorder refuses: they are columns of the run schema itself
RESERVED_NAMES = frozenset({STEP})

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_SKIP_KEYS = 1000  # distinct (reason, subject) pairs kept in ``skipped``


class InputChecksMixin:
    """Skipping and counting bad input to ``RunRecorder.log``."""

    max_metrics: int
    _names: dict[str, None]
    _skipped: dict[tuple[str, str], int]

    # ------------------------------------------------------------------ input validation

    def _skip(self, reason: str, subject: str, message: Callable[[], str], stacklevel: int = 3
              ) -> None:
        """Count a skipped input; warn the first time a (reason, subject) pair is seen."""
        key = (reason, subject)
        n = self._skipped.get(key)
        if n is not None:
            self._skipped[key] = n + 1
            return
        if len(self._skipped) >= _MAX_SKIP_KEYS:
            other = ("other", "")
            first = other not in self._skipped
            self._skipped[other] = self._skipped.get(other, 0) + 1
            if first:
                warnings.warn(
                    f"RunRecorder: {_MAX_SKIP_KEYS} kinds of bad input skipped; further ones are "
                    "counted under ('other', '') without a warning",
                    UserWarning,
                    stacklevel=stacklevel,
                )
            return
        self._skipped[key] = 1
        warnings.warn(f"RunRecorder: {message()}", UserWarning, stacklevel=stacklevel)

    def _convert(self, name: Any, value: Any) -> float | None:
        problem = ""
        if isinstance(value, (str, bytes, complex)) or _is_complex(value):
            pass
        else:
            try:
                return float(value)
            except Exception as exc:  # TypeError, OverflowError, a raising __float__, ...
                problem = f" ({type(exc).__name__}: {_text(exc)})"
        self._skip("bad_value", _subject(name), lambda: f"metric {_short(name)} has a "
                   f"non-numeric value of type {type(value).__name__}{problem}; skipped (warned "
                   "once per metric)", stacklevel=4)
        return None

    def _admit(self, name: Any) -> bool:
        """Validate a metric name seen for the first time; True adds it to the schema."""
        if not isinstance(name, str):
            self._skip("bad_name", _subject(name), lambda: "metric names must be str, got "
                       f"{_short(name)} ({type(name).__name__}); skipped", stacklevel=4)
            return False
        if name in RESERVED_NAMES:
            self._skip("reserved_name", name, lambda: f"metric name {name!r} is reserved for "
                       "the run schema; its values are skipped (log it under another name)",
                       stacklevel=4)
            return False
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            self._skip("bad_name", ascii(name)[:80], lambda: f"metric name {ascii(name)[:80]} "
                       "is not valid Unicode (a lone surrogate?); its values are skipped",
                       stacklevel=4)
            return False
        if len(self._names) >= self.max_metrics:
            self._skip("too_many_metrics", "", lambda: f"more than max_metrics="
                       f"{self.max_metrics} distinct metric names; new names are skipped "
                       f"(first: {name!r})", stacklevel=4)
            return False
        self._names[name] = None
        return True


def _as_step(step: Any) -> int | None:
    """``step`` as an int in the int64 range, or None."""
    if type(step) is int:
        return step if _INT64_MIN <= step <= _INT64_MAX else None
    if isinstance(step, bool):
        return None
    try:
        i = int(step)
        exact = bool(i == step)
    except Exception:
        return None
    return i if exact and _INT64_MIN <= i <= _INT64_MAX else None


def _is_complex(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    return getattr(dtype, "kind", "") == "c" or getattr(dtype, "is_complex", False) is True


def _subject(name: Any) -> str:
    return name if isinstance(name, str) and name.isprintable() else ascii(name)[:80]


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    return text if len(text) <= 80 else text[:77] + "..."


def _short(obj: Any) -> str:
    try:
        text = ascii(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
