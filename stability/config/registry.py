"""Detector registry: config names -> ``"module:Class"`` with lazy import and param validation.

Configs name detectors by short registry names (``ewma_z``, ``nonfinite``, ...; the table in
``docs/CONTRACTS.md``).  The class is imported only when first needed, so a config can be
parsed without importing every detector module.  Hyperparameters are validated by the detector
class's own ``__init__``; its ``ValueError`` is re-raised with the config key path in front.

Examples
--------
>>> detector_target("ewma_z")
'detectors.ewma:EWMAZScore'
>>> detector_class("nonfinite").__name__
'NonFiniteGuard'
>>> detector_class("ewma")
Traceback (most recent call last):
...
stability.config.registry.UnknownDetectorError: unknown detector 'ewma' (did you mean ...
>>> make_detector("ewma_z", {"alpha": 2.0}, where="detectors[1]")
Traceback (most recent call last):
...
stability.config.registry.ConfigError: detectors[1].params.alpha: The 'alpha' parameter ...
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from detectors import BankDetector

__all__ = [
    "REGISTRY",
    "RegistryEntry",
    "default_kind",
    "tune_grids",
    "ConfigError",
    "UnknownDetectorError",
    "DetectorUnavailableError",
    "register_detector",
    "known_detectors",
    "detector_target",
    "detector_class",
    "is_available",
    "make_detector",
    "did_you_mean",
]

@dataclass(frozen=True)
class RegistryEntry:
    """Everything the project knows about one registered detector, in one place.

    Parameters
    ----------
    target
        ``"module:Class"`` of the :class:`~detectors.BankDetector` subclass.
    kind
        Default alarm kind (``None`` = inferred from the bound signals, see
        :func:`stability.config.config.infer_kind`).
    grid
        Offline tuning grid (:func:`replay.tuning.tune`): parameter -> values tried besides the
        threshold; empty = only the threshold is tuned.
    doc
        One paragraph: how it works.  The detector tables of ``docs/concepts/detectors.md`` and
        ``docs/CONTRACTS.md`` are generated from the entries
        (``python -m stability.config.registry_docs``).

    >>> REGISTRY["page_hinkley"].kind, REGISTRY["ewma_z"].grid["alpha"]
    ('level_shift', (0.02, 0.05))
    """

    target: str
    kind: str | None = None
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    doc: str = ""


#: registry name -> spec (the only table to edit when a detector is added; the docs' tables are
#: generated from it)
REGISTRY: dict[str, RegistryEntry] = {
    "nonfinite": RegistryEntry(
        "detectors.nonfinite:NonFiniteGuard", "nonfinite",
        doc="Alarms on every NaN/±inf element. Keeps the count and the current streak."),
    "ewma_z": RegistryEntry(
        "detectors.ewma:EWMAZScore", None, {"alpha": (0.02, 0.05), "min_std": (0.01, 0.05, 0.1)},
        doc="z-score of `log(x)` against an exponentially weighted mean/variance (river's "
            "recurrence), with debiased warm-up and winsorised updates so one outlier cannot "
            'drag the statistics. "z > 2.5, EMA 0.97, 25 warm-up" is `alpha=0.03, warmup=25, '
            "threshold=2.5, log_space=False, debias=False, clip=inf`."),
    "robust_z": RegistryEntry(
        "detectors.robust:RobustZScore", None,
        {"window": (32, 128), "min_std": (0.01, 0.05, 0.1)},
        doc="median/MAD z-score over a ring buffer; a spike does not inflate the MAD, so "
            'repeated spikes keep alarming. "6σ over 128" is `window=128, robust=False, '
            "threshold=6, log_space=False`."),
    "ratio": RegistryEntry(
        "detectors.ratio:RatioToMean", None, {"window": (20, 100)},
        doc="x / reference (window median or mean, EW mean, or max of the first N values) that "
            'must exceed the threshold for `patience` steps. Covers "2× window mean for 5 '
            'steps", "3× the 10-step mean", "10× the max of the first 100".'),
    "page_hinkley": RegistryEntry(
        "detectors.page_hinkley:PageHinkley", "level_shift", {"delta": (0.02, 0.05)},
        doc="Page-Hinkley cumulative deviation test; drift indices identical to "
            "`river.drift.PageHinkley`."),
    "adwin": RegistryEntry(
        "detectors.adwin:ADWIN", "level_shift",
        doc="Adaptive windowing with an exponential histogram (a port of river's "
            "implementation); drift indices identical to `river.drift.ADWIN`."),
    "cusum": RegistryEntry(
        "detectors.cusum:CUSUM", "level_shift",
        doc="Two-sided tabular CUSUM on values standardised against a warm-up reference; "
            "catches small sustained level shifts."),
    "activation_shift": RegistryEntry(
        "detectors.activation:ActivationShift", "activation_shift",
        doc="Per layer: robust z of each activation statistic (scale statistics in log space) "
            "aggregated by RMS into one shift score per layer and step."),
    "histogram_drift": RegistryEntry(
        "detectors.activation:HistogramDrift", "activation_shift",
        doc="PSI between a reference window and the current window on reference-quantile "
            "bins, for drifts too slow for z-scores. Not bound by default: activation "
            "statistics trend during healthy training."),
    "train_val": RegistryEntry(
        "detectors.divergence:TrainValDivergence", "train_val_divergence",
        doc="At each validation point, the rise of log val loss not shared by the smoothed "
            "train loss; scores the t-statistic of its recent mean (a growing generalisation "
            "gap)."),
    "val_spike": RegistryEntry(
        "detectors.divergence:ValSpike", "train_val_divergence",
        doc="A validation point far above previous ones (robust scale of recent changes)."),
    "overfit_gap": RegistryEntry(
        "detectors.overfit:OverfitGap", "train_val_divergence",
        {"alpha": (0.1, 0.2, 0.3), "n_points": (3, 4)},
        doc="The train/validation gap grew at each of the last 4 validation points (train "
            "falling, val rising or stalled: memorisation)."),
    "lr_jump": RegistryEntry(
        "detectors.lr_loss:LRJump", "lr_loss_anomaly",
        doc="A change of log LR far beyond the schedule's typical step-to-step change "
            "(schedule bugs; increases by default, so step decays are benign)."),
    "lr_loss_corr": RegistryEntry(
        "detectors.lr_loss:LRLossCorrelation", "lr_loss_anomaly",
        doc="Rolling correlation of loss increases with LR increases, gated on the LR really "
            "rising."),
    "lr_level": RegistryEntry(
        "detectors.lr_loss:LRLevelInstability", "lr_loss_anomaly",
        doc="Loss volatility relative to its baseline, once the LR exceeds the highest LR seen "
            "while the loss was calm (LR too high)."),
    "tail_z": RegistryEntry(
        "detectors.tail:TailZScore", None, {"tail_q": (0.99, 0.999)},
        doc="EWMA z-score of `log(x)` divided by the run's own tail factor: a high quantile "
            "of the series' healthy scores against a Gaussian's (a z of 7 on a spiky "
            "small-batch SGD run counts for less than on a smooth LLM run); with `prior_std` "
            "it scores from the third value, its variance blended with the prior while "
            "warming up (no blind start)."),
    "no_update": RegistryEntry(
        "detectors.stall:UpdateStall", "stall",
        doc="Consecutive zero updates (`update_ratio` at or below `eps`) of a series that was "
            "updating before: an optimizer silently skipping its steps, a parameter group "
            "frozen by a bug. Never-moving series (unused parameters) score 0."),
    "no_progress": RegistryEntry(
        "detectors.progress:NoProgress", "stall",
        doc="Loss not decreasing: an EW mean of the values over the mean of the first "
            "`window`, scored once `horizon` values are seen (a run that never starts "
            "learning). Not bound by default: a run watched from its plateau is healthy."),
    "coherent_jump": RegistryEntry(
        "detectors.jump:CoherentJump", None,
        doc="A one-step rise of log x far beyond each series' typical step-to-step change in "
            "at least `min_series` series of the bank at once (several layers' gradients "
            "bursting together: an activation spike inside the network); a rise counts from "
            "the series' usual level when that is higher, so coming back after a collapse is "
            "not a jump."),
}


def default_kind(name: str) -> str | None:
    """The registered default alarm kind of ``name`` (``None``: inferred from the inputs).

    >>> default_kind("adwin"), default_kind("ewma_z"), default_kind("nope")
    ('level_shift', None, None)
    """
    spec = REGISTRY.get(name)
    return None if spec is None else spec.kind


def tune_grids() -> dict[str, dict[str, list[Any]]]:
    """The offline tuning grid of every registered detector that has one.

    >>> sorted(tune_grids())
    ['ewma_z', 'overfit_gap', 'page_hinkley', 'ratio', 'robust_z', 'tail_z']
    """
    return {n: {k: list(v) for k, v in s.grid.items()} for n, s in REGISTRY.items() if s.grid}


#: parameters the monitor manages itself (never allowed in ``params``)
_MANAGED = ("n_series",)
#: constructor arguments that receive the number of bound inputs when the class accepts them
_N_INPUT_ARGS = ("n_inputs", "n_features", "n_stats")

#: ``"module:Class"`` -> the imported class (classes registered as objects are put here)
_cache: dict[str, type[BankDetector]] = {}


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the offending key path."""


class UnknownDetectorError(ConfigError):
    """The registry has no detector of that name."""


class DetectorUnavailableError(ConfigError):
    """The detector is registered but its module cannot be imported (yet)."""


def did_you_mean(word: str, options: Any) -> str:
    """A ``" (did you mean 'x'?)"`` hint, or ``""`` when nothing is close.

    >>> did_you_mean("treshold", ["threshold", "alpha"])
    " (did you mean 'threshold'?)"
    """
    opts = [str(o) for o in options]
    close = difflib.get_close_matches(str(word), opts, n=1, cutoff=0.6)
    close = close or [o for o in opts if o.startswith(str(word)) and word][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def register_detector(name: str, target: str | type[BankDetector], kind: str | None = None,
                      grid: Mapping[str, Any] | None = None, doc: str = "") -> None:
    """Register a detector under ``name``: the one step that makes it usable by name.

    ``target`` is ``"module:Class"`` (imported when first used) or the class itself; ``kind``
    is its default alarm kind, ``grid`` its offline tuning grid and ``doc`` its row in the
    docs' tables (see :class:`RegistryEntry`).  Python-side only: configs can name registered
    detectors but never import arbitrary code.

    >>> from detectors import EWMAZScore
    >>> register_detector("my_z", EWMAZScore, kind="loss_spike", grid={"alpha": [0.1, 0.3]})
    >>> make_detector("my_z", {"alpha": 0.1}).alpha, tune_grids()["my_z"]
    (0.1, {'alpha': [0.1, 0.3]})
    >>> _ = REGISTRY.pop("my_z")
    """
    cls: type[BankDetector] | None = None
    if isinstance(target, type):
        if not issubclass(target, BankDetector):
            raise ValueError(f"register_detector: {target.__name__} is not a BankDetector.")
        cls, target = target, f"{target.__module__}:{target.__qualname__}"
    elif not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target):
        raise ValueError(
            f"register_detector: target must look like 'module:Class'; got {target!r}."
        )
    REGISTRY[name] = RegistryEntry(target, kind,
                                  {str(k): tuple(v) for k, v in dict(grid or {}).items()},
                                  str(doc))
    if cls is not None:
        _cache[target] = cls


def known_detectors() -> list[str]:
    """Registered names, sorted."""
    return sorted(REGISTRY)


def detector_target(name: str) -> str:
    """``"module:Class"`` for a registry name (raises :class:`UnknownDetectorError`)."""
    try:
        return REGISTRY[name].target
    except (KeyError, TypeError):
        raise UnknownDetectorError(
            f"unknown detector {name!r}{did_you_mean(name, REGISTRY)}; known: "
            f"{', '.join(known_detectors())}"
        ) from None


def detector_class(name: str) -> type[BankDetector]:
    """Import (once) and return the detector class registered under ``name``."""
    target = detector_target(name)
    cls = _cache.get(target)
    if cls is not None:
        return cls
    module, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DetectorUnavailableError(
            f"detector {name!r} ({target}) is not available: {exc}"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, BankDetector)):
        raise DetectorUnavailableError(f"detector {name!r} ({target}) is not a BankDetector.")
    _cache[target] = obj
    return obj


def is_available(name: str) -> bool:
    """``True`` when ``name`` is registered and its module imports."""
    try:
        detector_class(name)
    except ConfigError:
        return False
    return True


def _init_args(cls: type) -> list[str]:
    sig = inspect.signature(cls)
    return [p for p in sig.parameters if p != "self"]


def make_detector(
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    n_series: int = 1,
    n_inputs: int | None = None,
    where: str = "detector",
) -> BankDetector:
    """Instantiate a registered detector, turning bad parameters into :class:`ConfigError`.

    Parameters
    ----------
    name
        Registry name.
    params
        Hyperparameters (keyword arguments of the class).
    n_series
        Bank size.
    n_inputs
        Number of bound input patterns; checked against the detector's ``n_inputs`` (and passed
        as ``n_inputs`` / ``n_features`` when the class takes such an argument).
    where
        Key path of the binding in the config, used as the error prefix.

    Examples
    --------
    >>> make_detector("ewma_z", {"alpha": 0.1}, n_series=3).n_series
    3
    >>> make_detector("ewma_z", {"alpah": 0.1}, where="detectors[0]")
    Traceback (most recent call last):
    ...
    stability.config.registry.ConfigError: detectors[0].params: unknown parameter 'alpah' ...
    """
    try:
        cls = detector_class(name)
    except ConfigError as exc:
        raise type(exc)(f"{where}.detector: {exc}") from None
    kwargs = dict(params or {})
    allowed = _init_args(cls)
    for key in kwargs:
        if key in _MANAGED:
            raise ConfigError(f"{where}.params.{key}: set by the monitor; remove it from params.")
        if key not in allowed:
            known = [a for a in allowed if a not in _MANAGED]
            raise ConfigError(
                f"{where}.params: unknown parameter {key!r} for {name}{did_you_mean(key, known)}; "
                f"known: {', '.join(known)}"
            )
    if n_inputs is not None:
        for arg in _N_INPUT_ARGS:
            if arg in allowed and arg not in kwargs:
                kwargs[arg] = n_inputs
    try:
        det = cls(n_series=n_series, **kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        m = re.search(r"The '(\w+)' parameter", msg)
        key = f".{m.group(1)}" if m and m.group(1) in kwargs else ""
        raise ConfigError(f"{where}.params{key}: {msg}") from None
    if n_inputs is not None and det.n_inputs != n_inputs:
        names = ", ".join(det.input_names)
        raise ConfigError(
            f"{where}.inputs: {name} takes {det.n_inputs} input(s) ({names}); "
            f"got {n_inputs} pattern(s)."
        )
    return det
