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
stability.registry.UnknownDetectorError: unknown detector 'ewma' (did you mean 'ewma_z'?); ...
>>> make_detector("ewma_z", {"alpha": 2.0}, where="detectors[1]")
Traceback (most recent call last):
...
stability.registry.ConfigError: detectors[1].params.alpha: The 'alpha' parameter of EWMAZScore ...
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
        :func:`stability.config.infer_kind`).
    grid
        Offline tuning grid (:func:`replay.tuning.tune`): parameter -> values tried besides the
        threshold; empty = only the threshold is tuned.

    >>> REGISTRY["page_hinkley"].kind, REGISTRY["ewma_z"].grid["alpha"]
    ('level_shift', (0.02, 0.05))
    """

    target: str
    kind: str | None = None
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)


#: registry name -> spec (the only table to edit when a detector is added)
REGISTRY: dict[str, RegistryEntry] = {
    "nonfinite": RegistryEntry("detectors.nonfinite:NonFiniteGuard", "nonfinite"),
    "ewma_z": RegistryEntry("detectors.ewma:EWMAZScore", None,
                           {"alpha": (0.02, 0.05), "min_std": (0.01, 0.05, 0.1)}),
    "robust_z": RegistryEntry("detectors.robust:RobustZScore", None,
                             {"window": (32, 128), "min_std": (0.01, 0.05, 0.1)}),
    "ratio": RegistryEntry("detectors.ratio:RatioToMean", None, {"window": (20, 100)}),
    "page_hinkley": RegistryEntry("detectors.page_hinkley:PageHinkley", "level_shift",
                                 {"delta": (0.02, 0.05)}),
    "adwin": RegistryEntry("detectors.adwin:ADWIN", "level_shift"),
    "cusum": RegistryEntry("detectors.cusum:CUSUM", "level_shift"),
    "activation_shift": RegistryEntry("detectors.activation:ActivationShift", "activation_shift"),
    "histogram_drift": RegistryEntry("detectors.activation:HistogramDrift", "activation_shift"),
    "train_val": RegistryEntry("detectors.divergence:TrainValDivergence", "train_val_divergence"),
    "val_spike": RegistryEntry("detectors.divergence:ValSpike", "train_val_divergence"),
    "overfit_gap": RegistryEntry("detectors.overfit:OverfitGap", "train_val_divergence",
                                {"alpha": (0.1, 0.2, 0.3), "n_points": (3, 4)}),
    "lr_jump": RegistryEntry("detectors.lr_loss:LRJump", "lr_loss_anomaly"),
    "lr_loss_corr": RegistryEntry("detectors.lr_loss:LRLossCorrelation", "lr_loss_anomaly"),
    "lr_level": RegistryEntry("detectors.lr_loss:LRLevelInstability", "lr_loss_anomaly"),
    "coherent_jump": RegistryEntry("detectors.jump:CoherentJump", None),
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
    ['ewma_z', 'overfit_gap', 'page_hinkley', 'ratio', 'robust_z']
    """
    return {n: {k: list(v) for k, v in s.grid.items()} for n, s in REGISTRY.items() if s.grid}


#: parameters the monitor manages itself (never allowed in ``params``)
_MANAGED = ("n_series",)
#: constructor arguments that receive the number of bound inputs when the class accepts them
_N_INPUT_ARGS = ("n_inputs", "n_features", "n_stats")

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


def register_detector(name: str, target: str, kind: str | None = None,
                      grid: Mapping[str, Any] | None = None) -> None:
    """Register a detector under ``name`` (``target`` is ``"module:Class"``).

    ``kind`` is its default alarm kind and ``grid`` its offline tuning grid (see
    :class:`RegistryEntry`).  Python-side only: configs can name registered detectors but never
    import arbitrary code.
    """
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target):
        raise ValueError(
            f"register_detector: target must look like 'module:Class'; got {target!r}."
        )
    REGISTRY[name] = RegistryEntry(target, kind,
                                  {str(k): tuple(v) for k, v in dict(grid or {}).items()})
    _cache.pop(name, None)


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
    cls = _cache.get(name)
    if cls is not None:
        return cls
    target = detector_target(name)
    module, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DetectorUnavailableError(
            f"detector {name!r} ({target}) is not available: {exc}"
        ) from exc
    if not (isinstance(obj, type) and issubclass(obj, BankDetector)):
        raise DetectorUnavailableError(f"detector {name!r} ({target}) is not a BankDetector.")
    _cache[name] = obj
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
    stability.registry.ConfigError: detectors[0].params: unknown parameter 'alpah' for ewma_z ...
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
