"""The monitor's slot layout: names -> slots -> detector-bank inputs.

Every bound signal owns one *slot* of a float vector (``_vals``, with a presence mask
``_present``); slot 0 is "absent" and slot 1 a scratch slot for unbound names.  Each
``[[detectors]]`` binding (:class:`Binding`) maps its patterns' matches to series of its bank
(``slots[j][i]``: the slot feeding input ``j`` of series ``i``).  :meth:`Monitor._relayout`
builds the :class:`GatherPlan` that copies the slot vector into every bank's input in one Numba
call (:func:`stability.monitor.binding.gather_step`); the fill methods write one step's metrics and
families into the slot vector.

This module holds the layout's data types and constants; the layout itself is the
:class:`stability.monitor.monitor.Monitor`'s own state (its "layout" section).  See the
monitor's module docstring for the input policy.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any, NamedTuple

import numpy as np

from stability.config.config import DetectorSpec
from stability.config.registry import make_detector
from stability.monitor.binding import Pattern

__all__ = ["CAPPED", "MAX_STEP", "NO_PLAN", "PLAIN_TYPES", "SCRATCH", "Binding", "Family",
           "FamilyPlan", "GatherPlan", "KeyPlan"]

logger = logging.getLogger("stability.monitor")

#: Steps must be integers in ``[0, MAX_STEP]`` (exactly representable as float64).
MAX_STEP = 2**53 - 1
_ABSENT, SCRATCH = 0, 1
CAPPED = -2  # _lookup: a name every matching bank refused (series cap)
NO_PLAN: Any = object()
#: value types the fast path converts with ``array("d", ...)`` (real numbers, no ``__float__``
#: surprises: NumPy complex would silently lose its imaginary part there)
PLAIN_TYPES = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32,
                    np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_})


class KeyPlan(NamedTuple):
    """Slots of one key layout of ``metrics`` (cached for the two most recent layouts)."""

    keys: list[Any]
    slots: np.ndarray
    valid: bool              # every key is a valid name
    block: slice | None      # the slots form this contiguous range
    ones: bytes              # one 0x01 byte per key: "present" for the block
    pack: Any                # ``struct.Struct(f"{n}d").pack_into``: the values, as doubles...
    buf: array               # ... into this buffer (then one copy into the slot vector)
    arr: np.ndarray          # ``buf`` as float64 (for scattered slots)


class FamilyPlan(NamedTuple):
    """Families given together that fill one contiguous slot block ``[lo, hi)``."""

    lo: int
    hi: int
    shapes: list[tuple[int]]
    spans: list[slice]       # each family's part of the block
    ones: bytes              # ``hi - lo`` bytes 0x01: "present" for the block
    block: slice             # ``[lo, hi)``


class Family(NamedTuple):
    """A declared per-layer family: layer names, their slots, contiguous block or ``None``."""

    layers: list[str]
    slots: np.ndarray
    block: slice | None


class GatherPlan(NamedTuple):
    """Arguments of :func:`stability.monitor.binding.gather_step` after the slot vector and mask.

    A tuple, so ``gather_step(vals, present, *plan)`` takes it as is.
    """

    gidx: np.ndarray         # slot feeding element k of the concatenated inputs
    boff: np.ndarray         # binding b owns inputs[boff[b]:boff[b+1]]
    soff: np.ndarray         # ... and scores/alarms[soff[b]:soff[b+1]]
    inputs: np.ndarray       # all banks' inputs, concatenated
    missing: np.ndarray      # their missing mask
    scores: np.ndarray       # all banks' scores (the banks write here)
    alarms: np.ndarray       # all banks' alarms
    active: np.ndarray       # binding b had any input present this step


class Binding:
    """Runtime side of one ``[[detectors]]`` entry: patterns, series, slots, detector, views.

    ``inputs``/``missing`` (``(1, n_inputs, n_series)``) and ``scores``/``alarms``
    (``(1, n_series)``) are views into the monitor's :class:`GatherPlan` buffers.
    """

    __slots__ = ("spec", "name", "kind", "severity", "critical_factor", "nonfinite", "patterns",
                 "n_inputs", "det", "keys", "key_index", "slots", "inputs", "missing", "scores",
                 "alarms")

    def __init__(self, spec: DetectorSpec, where: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.kind = spec.kind
        self.severity = spec.severity
        self.critical_factor = spec.critical_factor
        self.nonfinite = spec.kind == "nonfinite"
        self.patterns = [Pattern(p) for p in spec.inputs]
        self.n_inputs = len(self.patterns)
        self.det = make_detector(spec.detector, spec.params, n_series=0,
                                 n_inputs=self.n_inputs, where=where)
        self.keys: list[str] = []
        self.key_index: dict[str, int] = {}
        self.slots: list[list[int]] = [[] for _ in self.patterns]  # slots[j][i]
        self.inputs: np.ndarray | None = None
        self.missing: np.ndarray | None = None
        self.scores: np.ndarray | None = None
        self.alarms: np.ndarray | None = None

    def add_series(self, key: str) -> int:
        i = len(self.keys)
        self.keys.append(key)
        self.key_index[key] = i
        for col in self.slots:
            col.append(_ABSENT)
        return i

    def slot_index(self) -> np.ndarray:
        """``(n_inputs, n_series)`` slot of every input of every series."""
        return np.asarray(self.slots, dtype=np.int64).reshape(self.n_inputs, len(self.keys))


