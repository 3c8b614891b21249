"""Declared hyperparameters: one constraint per argument, written once on the detector class.

scikit-learn declares ``_parameter_constraints = {"window": [Interval(Integral, 2, None,
closed="left")]}`` on an estimator and validates from it; a detector here declares::

    class RobustZScore(BankDetector):
        parameter_constraints = {
            "window": Int(1, MAX_WINDOW),
            "warmup": Int(1, "window", derive=_default_warmup),   # at most the window
            "direction": Choice(DIRECTIONS),                     # a name -> kernel value map
            ...
        }

and everything else follows from that table (:class:`~detectors.BankDetector`): the checks in
``__init__`` (the messages of :mod:`detectors.validation`, scikit-learn's wording), the
``hyperparameters`` tuple, the kernel's ``params`` values (a :class:`Choice` over a mapping gives
the mapped number), ``set_threshold``'s check, the conformance suite's bad-parameter cases
(:meth:`Constraint.invalid`, :meth:`Constraint.edges`) and the parameter reference in the docs
(:meth:`Constraint.rule`).

A bound may be a number, the name of a parameter declared earlier (``"window"``: its value)
or a function of the detector being built, so rules between parameters are declared too.

Examples
--------
>>> Int(2).rule(None), Float(0.0, 1.0, low_open=True).rule(None)
('an int in the range [2, inf)', 'a float in the range (0.0, 1.0]')
>>> Choice({"up": 1.0, "down": -1.0}).check("EWMAZScore", "direction", "down", None)
'down'
>>> Int(2).check("EWZScore", "window", 0, None)
Traceback (most recent call last):
...
ValueError: The 'window' parameter of EWZScore must be an int in the range [2, inf). Got 0 instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .validation import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    choice_rule,
    float_rule,
    int_rule,
    param_error,
)

__all__ = ["Bool", "Bound", "Choice", "Constraint", "Flags", "Float", "Int", "arguments"]

#: a range end: a number, the name of a parameter declared before this one, or a function of
#: the detector being built (its earlier parameters are already set)
Bound = float | str | Callable[[Any], float]


def _resolve(bound: Bound, det: Any) -> float:
    if isinstance(bound, str):
        return float(getattr(det, bound))
    if callable(bound):
        return float(bound(det))
    return float(bound)


def arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """A constructor's arguments from its ``locals()``: ``self`` and ``__class__`` dropped.

    A declared detector's ``__init__`` is its signature and one line,
    ``super().__init__(**arguments(locals()))``.

    >>> arguments({"self": object(), "__class__": int, "alpha": 0.1})
    {'alpha': 0.1}
    """
    return {k: v for k, v in values.items() if k not in ("self", "__class__")}


class Constraint:
    """What one hyperparameter accepts.  Subclasses implement :meth:`check` and :meth:`rule`."""

    def check(self, owner: str, name: str, value: Any, det: Any) -> Any:
        """The accepted value (converted, e.g. an int for an integral NumPy scalar), or raise
        the scikit-learn style ``ValueError`` naming ``owner`` and ``name``."""
        raise NotImplementedError

    def rule(self, det: Any) -> str:
        """The rule in words (``"an int in the range [2, inf)"``), bounds resolved on ``det``."""
        raise NotImplementedError

    def kernel_value(self, value: Any) -> float:
        """The number the kernel reads for an accepted ``value`` (its ``params`` entry)."""
        return float(value)

    def invalid(self, det: Any) -> list[tuple[Any, str]]:
        """Values this constraint refuses on ``det`` (just outside each end, the wrong type),
        each with the rule its error message states."""
        return [(v, self.rule(det)) for v in self._invalid_values(det)]

    def _invalid_values(self, det: Any) -> tuple[Any, ...]:
        return ()

    def edges(self, det: Any) -> tuple[Any, ...]:
        """The closed ends of the range on ``det``: values this constraint accepts."""
        return ()


@dataclass(frozen=True)
class Int(Constraint):
    """An int (not a ``bool``, not a float) in ``[lo, hi]``.

    ``derive``: the value taken when the argument is ``None`` (a default that depends on other
    parameters), as a function of the detector.
    """

    lo: Bound = -math.inf
    hi: Bound = math.inf
    derive: Callable[[Any], int] | None = None

    def check(self, owner: str, name: str, value: Any, det: Any) -> int:
        if value is None and self.derive is not None:
            value = self.derive(det)
        return check_int(owner, name, value, _resolve(self.lo, det), _resolve(self.hi, det))

    def rule(self, det: Any) -> str:
        return int_rule(_resolve(self.lo, det), _resolve(self.hi, det))

    def _invalid_values(self, det: Any) -> tuple[Any, ...]:
        lo, hi = _resolve(self.lo, det), _resolve(self.hi, det)
        ends = [int(lo) - 1] if math.isfinite(lo) else []
        ends += [int(hi) + 1] if math.isfinite(hi) else []
        return (*ends, 2.5, True, "3")

    def edges(self, det: Any) -> tuple[Any, ...]:
        return tuple(int(b) for b in (_resolve(self.lo, det), _resolve(self.hi, det))
                     if math.isfinite(b))


@dataclass(frozen=True)
class Float(Constraint):
    """A float in the range (ints and NumPy numbers count, ``bool`` and NaN never; ``+-inf``
    where a closed, infinite end reaches it)."""

    lo: Bound = -math.inf
    hi: Bound = math.inf
    low_open: bool = False
    high_open: bool = False

    def check(self, owner: str, name: str, value: Any, det: Any) -> float:
        return check_float(owner, name, value, _resolve(self.lo, det), _resolve(self.hi, det),
                           low_open=self.low_open, high_open=self.high_open)

    def rule(self, det: Any) -> str:
        return float_rule(_resolve(self.lo, det), _resolve(self.hi, det),
                          low_open=self.low_open, high_open=self.high_open)

    def _invalid_values(self, det: Any) -> tuple[Any, ...]:
        lo, hi = _resolve(self.lo, det), _resolve(self.hi, det)
        out: list[Any] = []
        if math.isfinite(lo):
            out.append(lo if self.low_open else math.nextafter(lo, -math.inf))
        elif self.low_open:
            out.append(-math.inf)
        if math.isfinite(hi):
            out.append(hi if self.high_open else math.nextafter(hi, math.inf))
        elif self.high_open:
            out.append(math.inf)
        return (*out, math.nan, True, "1.0")

    def edges(self, det: Any) -> tuple[Any, ...]:
        lo, hi = _resolve(self.lo, det), _resolve(self.hi, det)
        return tuple(b for b, is_open in ((lo, self.low_open), (hi, self.high_open))
                     if not is_open)


@dataclass(frozen=True)
class Bool(Constraint):
    """A bool (NumPy's too; not ``0`` / ``1``).  ``only``: the one value allowed, ``why`` says
    why (``Bool(only=False, why="the guard has no statistics to freeze")``)."""

    only: bool | None = None
    why: str = ""

    def check(self, owner: str, name: str, value: Any, det: Any) -> bool:
        v = check_bool(owner, name, value)
        if self.only is not None and v != self.only:
            raise param_error(owner, name, self.rule(det), value)
        return v

    def rule(self, det: Any) -> str:
        if self.only is None:
            return "a bool"
        return f"{self.only}: {self.why}" if self.why else str(self.only)

    def invalid(self, det: Any) -> list[tuple[Any, str]]:
        wrong_type = [(1, "a bool"), ("yes", "a bool")]
        return wrong_type if self.only is None else [*wrong_type, (not self.only, self.rule(det))]

    def edges(self, det: Any) -> tuple[Any, ...]:
        return (True, False) if self.only is None else (self.only,)


@dataclass(frozen=True)
class Choice(Constraint):
    """One of ``options``; over a mapping, the kernel reads the mapped number.

    ``Choice({"up": 1.0, "down": -1.0, "both": 0.0})`` accepts ``"down"``, stores it as it is
    and gives the kernel ``-1.0``.
    """

    options: Mapping[str, float] | tuple[str, ...]

    def check(self, owner: str, name: str, value: Any, det: Any) -> Any:
        return check_choice(owner, name, value, self.options)

    def rule(self, det: Any) -> str:
        return choice_rule(self.options)

    def kernel_value(self, value: Any) -> float:
        if isinstance(self.options, Mapping):
            return float(self.options[value])
        return float(value)

    def _invalid_values(self, det: Any) -> tuple[Any, ...]:
        return ("no-such-choice", 3, None)

    def edges(self, det: Any) -> tuple[Any, ...]:
        return tuple(self.options)


@dataclass(frozen=True)
class Flags(Constraint):
    """One bool for every item, or a sequence of ``count`` bools (stored as a tuple).

    >>> Flags(2).check("ActivationShift", "log_space", True, None)
    (True, True)
    """

    count: Bound

    def check(self, owner: str, name: str, value: Any, det: Any) -> tuple[bool, ...]:
        n = int(_resolve(self.count, det))
        if isinstance(value, (bool, np.bool_)):
            return (bool(value),) * n
        try:
            flags = tuple(check_bool(owner, name, b) for b in value)
        except (TypeError, ValueError):
            flags = ()
        if len(flags) != n:
            raise param_error(owner, name, self.rule(det), value)
        return flags

    def rule(self, det: Any) -> str:
        n = int(_resolve(self.count, det))
        return f"a bool or a sequence of {n} bools (one per feature)"

    def _invalid_values(self, det: Any) -> tuple[Any, ...]:
        n = int(_resolve(self.count, det))
        return (1, "yes", (True,) * (n + 1), (1,) * n)

    def edges(self, det: Any) -> tuple[Any, ...]:
        n = int(_resolve(self.count, det))
        return (True, (False,) * n)
