"""Numba-jitted online detectors for training-run metrics (pure numerics: NumPy + Numba).

Every detector is a bank of independent series updated by one kernel call per step
(:meth:`~detectors._base.BankDetector.update`) or per batch
(:meth:`~detectors._base.BankDetector.update_many`); both share the same kernel.
"""

from ._base import MAD_SCALE, BankDetector, BoolArray, FloatArray
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
    "MAD_SCALE",
    "BoolArray",
    "FloatArray",
    "EWMAZScore",
    "NonFiniteGuard",
    "RatioToMean",
    "RobustZScore",
]
