"""Numba-jitted online detectors for training-run metrics (pure numerics: NumPy + Numba).

Every detector is a bank of independent series updated by one kernel call per step
(:meth:`~detectors.BankDetector.update`) or per batch
(:meth:`~detectors.BankDetector.update_many`); both share the same kernel.

Writing a detector takes :class:`BankDetector`, :class:`StateCheck` (its snapshot invariants),
the kernel prologue (:func:`skip_value`, :func:`skip_pair`, :func:`learns`, :func:`indices`) and
the parameter declarations (:class:`Int`, :class:`Float`, :class:`Bool`, :class:`Choice`,
:class:`Flags` in ``parameter_constraints``; ``__init__`` is ``super().__init__(**arguments(
locals()))``).  A detector class in any public module of
this package is importable from here (``from detectors import MyDetector``) without editing this
file: the names below are the built-in ones, spelled out for type checkers.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._base import MAD_SCALE, BankDetector, BoolArray, FloatArray
from ._kernel import indices, learns, skip_pair, skip_value
from ._params import Bool, Choice, Constraint, Flags, Float, Int, arguments
from ._state import StateCheck
from .activation import ActivationShift, HistogramDrift
from .adwin import ADWIN
from .cusum import CUSUM
from .divergence import TrainValDivergence, ValSpike
from .ewma import EWMAZScore
from .lr_loss import LRJump, LRLevelInstability, LRLossCorrelation
from .nonfinite import NonFiniteGuard
from .page_hinkley import PageHinkley
from .ratio import RatioToMean
from .robust import RobustZScore

__all__ = [
    "ADWIN",
    "CUSUM",
    "PageHinkley",
    "ActivationShift",
    "HistogramDrift",
    "LRJump",
    "LRLevelInstability",
    "LRLossCorrelation",
    "TrainValDivergence",
    "ValSpike",
    "BankDetector",
    "Bool",
    "Choice",
    "Constraint",
    "Flags",
    "Float",
    "Int",
    "arguments",
    "MAD_SCALE",
    "BoolArray",
    "FloatArray",
    "EWMAZScore",
    "NonFiniteGuard",
    "RatioToMean",
    "RobustZScore",
    "StateCheck",
    "indices",
    "learns",
    "skip_pair",
    "skip_value",
]


def __getattr__(name: str) -> type[BankDetector]:
    """``detectors.<Class>`` for a detector class defined in any public module of the package.

    A new detector module needs no edit here; its registry entry (``stability/config/registry.py``)
    names it by ``"detectors.module:Class"`` anyway.
    """
    if not name.startswith("_"):
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            obj = vars(module).get(name)
            if isinstance(obj, type) and issubclass(obj, BankDetector) and \
                    obj.__module__ == module.__name__:
                return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
