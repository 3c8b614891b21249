"""Discovery of every bank detector class in ``detectors/`` (for the reliability tests)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import detectors
from detectors._base import BankDetector


def all_detector_classes() -> list[type[BankDetector]]:
    """Every concrete :class:`BankDetector` subclass defined in the ``detectors`` package."""
    out: list[type[BankDetector]] = []
    for info in pkgutil.iter_modules(detectors.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"detectors.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if (issubclass(cls, BankDetector) and cls is not BankDetector
                    and cls.__module__ == mod.__name__ and not inspect.isabstract(cls)):
                out.append(cls)
    return sorted(out, key=lambda c: c.__name__)
