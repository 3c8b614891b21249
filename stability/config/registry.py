"""Detector registry: config names -> ``"module:Class"`` with lazy import and param validation.

Configs name detectors by short registry names (``ewma_z``, ``nonfinite``, ...; the table in
``docs/CONTRACTS.md``).  The registry holds one line per detector, its name and class; what
else it says about it (default alarm kind, tuning grid, docs row) is declared on the class and
read from there.  The class is imported only when first needed.  Hyperparameters are validated
by the detector class's own ``__init__`` (from its declared ``parameter_constraints``); its
``ValueError`` is re-raised with the config key path in front.

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
    "BUILTIN",
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

#: an argument of :func:`register_detector` that was not given (the class's declaration holds)
_FROM_CLASS: Any = object()


@dataclass(frozen=True)
class RegistryEntry:
    """One registered detector: its class, and what the project knows of it from the class.

    The default alarm kind, the tuning grid and the docs row are declared on the detector class
    (:attr:`~detectors.BankDetector.kind`, :attr:`~detectors.BankDetector.tuning_grid`,
    :attr:`~detectors.BankDetector.summary`) and read from it when first asked for (the class
    is imported then); :func:`register_detector` may give other values for one name.

    Parameters
    ----------
    target
        ``"module:Class"`` of the :class:`~detectors.BankDetector` subclass.
    given
        Values given at registration instead of the class's: ``kind`` (``None`` = inferred from
        the bound signals, see :func:`stability.config.config.infer_kind`), ``grid`` (offline
        tuning grid of :func:`replay.tuning.tune`: parameter -> values tried besides the
        threshold) and ``doc`` (one paragraph, how it works: the row in the detector tables of
        ``docs/concepts/detectors.md`` and ``docs/CONTRACTS.md``, ``python -m
        stability.config.registry_docs``).

    >>> REGISTRY["page_hinkley"].kind, REGISTRY["ewma_z"].grid["alpha"]
    ('level_shift', (0.02, 0.05))
    """

    target: str
    given: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type[BankDetector]:
        """The detector class (imported once; :class:`DetectorUnavailableError` if it cannot)."""
        return _load(self.target, self.target)

    @property
    def kind(self) -> str | None:
        """Default alarm kind (``None``: inferred from the bound signals)."""
        return self.given["kind"] if "kind" in self.given else self.cls.kind

    @property
    def grid(self) -> Mapping[str, tuple[Any, ...]]:
        """Offline tuning grid: parameter -> values tried besides the threshold."""
        return self.given["grid"] if "grid" in self.given else self.cls.tuning_grid

    @property
    def doc(self) -> str:
        """One paragraph: how it works (its row in the docs' tables)."""
        return self.given["doc"] if "doc" in self.given else self.cls.summary


#: registry name -> the class (the one line to add for a built-in detector; its kind, tuning
#: grid and docs row are declared on the class, and the docs' tables are generated from both)
BUILTIN: dict[str, str] = {
    "nonfinite": "detectors.nonfinite:NonFiniteGuard",
    "ewma_z": "detectors.ewma:EWMAZScore",
    "robust_z": "detectors.robust:RobustZScore",
    "ratio": "detectors.ratio:RatioToMean",
    "page_hinkley": "detectors.page_hinkley:PageHinkley",
    "adwin": "detectors.adwin:ADWIN",
    "cusum": "detectors.cusum:CUSUM",
    "activation_shift": "detectors.activation:ActivationShift",
    "histogram_drift": "detectors.activation:HistogramDrift",
    "train_val": "detectors.divergence:TrainValDivergence",
    "val_spike": "detectors.divergence:ValSpike",
    "overfit_gap": "detectors.overfit:OverfitGap",
    "lr_jump": "detectors.lr_loss:LRJump",
    "lr_loss_corr": "detectors.lr_loss:LRLossCorrelation",
    "lr_level": "detectors.lr_loss:LRLevelInstability",
    "tail_z": "detectors.tail:TailZScore",
    "no_update": "detectors.stall:UpdateStall",
    "no_progress": "detectors.progress:NoProgress",
    "coherent_jump": "detectors.jump:CoherentJump",
}

#: registry name -> entry: the built-in ones, then those of :func:`register_detector`
REGISTRY: dict[str, RegistryEntry] = {name: RegistryEntry(t) for name, t in BUILTIN.items()}


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


def register_detector(name: str, target: str | type[BankDetector], kind: Any = _FROM_CLASS,
                      grid: Mapping[str, Any] | None = None, doc: Any = _FROM_CLASS) -> None:
    """Register a detector under ``name``: the one step that makes it usable by name.

    ``target`` is ``"module:Class"`` (imported when first used) or the class itself.  Its
    default alarm kind, offline tuning grid and docs row are the class's declarations
    (``kind``, ``tuning_grid``, ``summary``; see :class:`RegistryEntry`) unless given here.
    Python-side only: configs can name registered detectors but never import arbitrary code.

    >>> from detectors import EWMAZScore
    >>> register_detector("my_z", EWMAZScore, kind="loss_spike", grid={"alpha": [0.1, 0.3]})
    >>> make_detector("my_z", {"alpha": 0.1}).alpha, tune_grids()["my_z"]
    (0.1, {'alpha': [0.1, 0.3]})
    >>> REGISTRY["my_z"].doc == EWMAZScore.summary
    True
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
    given: dict[str, Any] = {}
    if kind is not _FROM_CLASS:
        given["kind"] = kind
    if grid is not None:
        given["grid"] = {str(k): tuple(v) for k, v in dict(grid).items()}
    if doc is not _FROM_CLASS:
        given["doc"] = str(doc)
    REGISTRY[name] = RegistryEntry(target, given)
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


def _load(target: str, label: str) -> type[BankDetector]:
    """Import (once) the class ``"module:Class"`` (errors start with ``label``)."""
    cls = _cache.get(target)
    if cls is not None:
        return cls
    module, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DetectorUnavailableError(f"{label} is not available: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, BankDetector)):
        raise DetectorUnavailableError(f"{label} is not a BankDetector.")
    _cache[target] = obj
    return obj


def detector_class(name: str) -> type[BankDetector]:
    """Import (once) and return the detector class registered under ``name``."""
    target = detector_target(name)
    return _load(target, f"detector {name!r} ({target})")


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
