"""The monitor's slot layout: names -> slots -> detector-bank inputs.

Every bound signal owns one *slot* of a float vector (``_vals``, with a presence mask
``_present``); slot 0 is "absent" and slot 1 a scratch slot for unbound names.  Each
``[[detectors]]`` binding (:class:`_Binding`) maps its patterns' matches to series of its bank
(``slots[j][i]``: the slot feeding input ``j`` of series ``i``).  :meth:`LayoutMixin._relayout`
builds the :class:`GatherPlan` that copies the slot vector into every bank's input in one Numba
call (:func:`stability.monitor.binding.gather_step`); the fill methods write one step's metrics and
families into the slot vector.

This module holds the layout half of :class:`stability.monitor.monitor.Monitor` (a mixin); see the
monitor's module docstring for the input policy.
"""

from __future__ import annotations

import logging
import math
import struct
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from detectors.dispatch import compiling
from stability.config.config import DetectorSpec
from stability.config.registry import make_detector
from stability.monitor.binding import Aliases, OwnNames, Pattern, empty_buffers
from stability.monitor.fused import N_TRACKED, FusedPlan, build_fused_plan, step_buffers
from stability.monitor.io import to_float

__all__ = ["MAX_STEP", "GatherPlan", "LayoutMixin"]

logger = logging.getLogger("stability.monitor")

#: Steps must be integers in ``[0, MAX_STEP]`` (exactly representable as float64).
MAX_STEP = 2**53 - 1
_ABSENT, _SCRATCH = 0, 1
_CAPPED = -2  # _lookup: a name every matching bank refused (series cap)
_NO_PLAN: Any = object()
#: value types the fast path converts with ``array("d", ...)`` (real numbers, no ``__float__``
#: surprises: NumPy complex would silently lose its imaginary part there)
_PLAIN = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32,
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


class _Binding:
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


class LayoutMixin:
    """Names, slots, families and the gather plan of a
    :class:`~stability.monitor.monitor.Monitor`."""

    strict: bool
    max_series: int
    counters: dict[str, int]
    _alias: Aliases
    _own: OwnNames
    _bindings: list[_Binding]
    _capped_banks: set[str]
    _gather: GatherPlan
    _calls: list[tuple[Any, Any, Any]]
    _fused: FusedPlan | None
    _fused_args: tuple[np.ndarray, ...]
    _fused_wait: bool  # no fused plan yet: kernels compile in the background
    _tslots: np.ndarray
    _tracked: np.ndarray

    last_step: int

    def _reset_layout(self) -> None:
        self._slot_names: list[str] = ["<absent>", "<scratch>"]
        self._slot_of: dict[str, int] = {}
        self._cache: dict[Any, int] = {}
        self.unbound: set[str] = set()
        self._families: dict[str, Family] = {}
        self._fam_plans: dict[tuple[str, ...], FamilyPlan | None] = {}
        self._set_slot_buffers(*empty_buffers(64))
        # the two most recent key layouts of ``metrics`` (e.g. with and without val_loss)
        self._key_plans: list[KeyPlan] = []
        self._dirty = True
        self._fused = None
        self._fused_args = ()
        self._fused_wait = False
        self._tslots = np.zeros(N_TRACKED, dtype=np.int64)  # grad_norm, lr, loss, val_loss
        self._tracked = np.zeros(2 * N_TRACKED)  # ... their values and presence (capture)
        self._grad_slot = 0
        self._lr_slot = 0
        self._loss_slot = 0
        self._val_slot = 0

    def _set_slot_buffers(self, vals: np.ndarray, present: np.ndarray) -> None:
        """Install the slot vector and presence mask, and the raw views the fast fills write
        through (a memoryview slice assignment is a checked ``memcpy``: it refuses another
        format or shape instead of converting)."""
        self._vals, self._present = vals, present
        self._vals_mv = memoryview(vals)  # type: ignore[arg-type]
        self._present_mv = memoryview(present.view(np.uint8))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ public helpers
    @property
    def signals(self) -> list[str]:
        """Canonical names of the bound signals, in slot order."""
        return self._slot_names[2:]

    def series(self, binding: str) -> list[str]:
        """Series keys of a binding, in bank order."""
        for b in self._bindings:
            if b.name == binding:
                return list(b.keys)
        raise KeyError(f"no binding named {binding!r}; "
                       f"bindings: {[b.name for b in self._bindings]}")

    def detector(self, binding: str) -> Any:
        """The detector bank of a binding."""
        for b in self._bindings:
            if b.name == binding:
                return b.det
        raise KeyError(f"no binding named {binding!r}")

    # ------------------------------------------------------------------ name resolution
    def _lookup(self, raw: Any) -> int:
        """Slot of a raw metric name (cached): ``>= 2`` bound, 1 unbound, -1 invalid name."""
        s = self._cache.get(raw)
        if s is not None:
            return s
        if not isinstance(raw, str):
            return -1
        name = self._alias(raw)
        s = self._slot_of.get(name)
        if s is None:
            s = self._bind(name)
            if s == _CAPPED or (s == _SCRATCH and len(self.unbound) >= self.max_series):
                return s  # not cached: memory stays bounded under endless new names
        self._cache[raw] = s
        return s

    def _bind(self, name: str) -> int:
        if self._own(name):  # the guard's own logs are never inputs (binding.OwnNames)
            return _SCRATCH
        hits = []
        for b in self._bindings:
            for j, p in enumerate(b.patterns):
                key = p.match(name)
                if key is not None:
                    hits.append((b, j, key))
        if not hits:
            if len(self.unbound) < self.max_series:
                self.unbound.add(name)
            return _SCRATCH
        cap = self.max_series
        kept = [h for h in hits if h[2] in h[0].key_index or len(h[0].keys) < cap]
        if len(kept) < len(hits):
            for b, _, _ in hits:
                if b.name not in self._capped_banks and len(b.keys) >= cap:
                    self._capped_banks.add(b.name)
                    logger.warning("binding %r holds max_series=%d series; new names it matches "
                                   "(first: %r) are not added to it. Raise [monitor] max_series "
                                   "if this is intended.", b.name, cap, name)
            if not kept:
                return _CAPPED
            hits = kept
        s = len(self._slot_names)
        self._slot_names.append(name)
        self._slot_of[name] = s
        if s >= self._vals.shape[0]:
            vals, present = empty_buffers(2 * s)
            vals[: s] = self._vals
            present[: s] = self._present
            self._set_slot_buffers(vals, present)
        for b, j, key in hits:
            i = b.key_index.get(key)
            if i is None:
                i = b.add_series(key)
                b.det.grow(1)
            b.slots[j][i] = s
        if name == "grad_norm":
            self._grad_slot = s
        elif name == "lr":
            self._lr_slot = s
        elif name == "loss":
            self._loss_slot = s
        elif name == "val_loss":
            self._val_slot = s
        self._dirty = True
        return s

    def declare_family(self, name: str, layers: Sequence[str]) -> None:
        """Declare the layer order of a per-layer family for ``observe(..., families=...)``.

        ``families={name: array}`` is then equivalent to the keys ``f"{name}/{layer}"``
        (arrays must have ``len(layers)`` elements).  Re-declaring replaces the layer list.
        """
        layers = [str(x) for x in layers]
        if len(set(layers)) != len(layers):
            raise ValueError(f"declare_family({name!r}): layer names must be unique.")
        slots = np.array([max(self._lookup(f"{name}/{x}"), _SCRATCH) for x in layers],
                         dtype=np.int64)  # a capped layer is written to the scratch slot
        n = len(slots)
        contig = slice(int(slots[0]), int(slots[0]) + n) if n and np.array_equal(
            slots, np.arange(slots[0], slots[0] + n)) else None
        self._families[name] = Family(layers, slots, contig)
        self._fam_plans.clear()

    @property
    def families(self) -> dict[str, list[str]]:
        """Declared families and their layer order."""
        return {k: list(v.layers) for k, v in self._families.items()}

    # ------------------------------------------------------------------ gather plan
    def _relayout(self) -> None:
        bs = self._bindings
        sizes = [b.n_inputs * len(b.keys) for b in bs]
        counts = [len(b.keys) for b in bs]
        sb = step_buffers(len(bs), sum(sizes), sum(counts))
        boff, soff = sb.boff, sb.soff
        boff[1:] = np.cumsum(sizes)
        soff[1:] = np.cumsum(counts)
        gidx, x_all, m_all, s_all, a_all = sb.gidx, sb.X, sb.M, sb.S, sb.A
        m_all[:] = True
        s_all[:] = np.nan
        calls = []
        for k, b in enumerate(bs):
            n, lo, hi = len(b.keys), int(boff[k]), int(boff[k + 1])
            if n:
                gidx[lo:hi] = np.asarray(b.slots, dtype=np.int64).reshape(-1)
            b.inputs = x_all[lo:hi].reshape(1, b.n_inputs, n)
            b.missing = m_all[lo:hi].reshape(1, b.n_inputs, n)
            so, se = int(soff[k]), int(soff[k + 1])
            s_all[so:se] = b.det.score
            a_all[so:se] = b.det.alarm
            # the bank writes its outputs straight into the monitor's shared vectors
            b.scores = s_all[so:se].reshape(1, n)
            b.alarms = a_all[so:se].reshape(1, n)
            b.det.bind_outputs(b.scores, b.alarms)
            calls.append((b.det.update_array, b.inputs, b.missing))
        self._gather = GatherPlan(gidx, boff, soff, x_all, m_all, s_all, a_all, sb.active)
        self._calls = calls
        sb.tslots[:] = (self._grad_slot, self._lr_slot, self._loss_slot, self._val_slot)
        self._tslots, self._tracked = sb.tslots, sb.tracked
        # one native call per step (gather + banks + alarm count); None: the plain path
        self._fused = build_fused_plan(sb, [b.det for b in bs], [b.n_inputs for b in bs],
                                       counts, self._vals, self._present)
        # the driver's argument tuple (the slot vector is replaced only with a relayout)
        self._fused_args = self._fused.args if self._fused else ()
        self._fused_wait = self._fused is None and compiling()  # kernels compile aside
        self._dirty = False

    def _live_rows(self) -> list[tuple[_Binding, Any, Any]]:
        """``(binding, scores, alarms)`` of the step just gathered, for ``_make_alarms``."""
        return [(b, b.scores[0], b.alarms[0]) for b in self._bindings]  # type: ignore[index]

    # ------------------------------------------------------------------ filling a step
    def _bad(self, msg: str, skipped: list[str], capped: bool = False) -> None:
        if self.strict and not capped:  # a full bank is a resource limit, not bad input
            raise ValueError(msg)
        skipped.append(msg)
        self.counters["skipped_values"] += 1

    def _check_step(self, step: Any, skipped: list[str]) -> int | None:
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer, float)):
            self._bad(f"step: must be an int; got {step!r}", skipped)
            return None
        if isinstance(step, float) and not (math.isfinite(step) and step.is_integer()):
            self._bad(f"step: must be an int; got {step!r}", skipped)
            return None
        s = int(step)
        if s < 0:
            self._bad(f"step {s}: negative step; not fed to detectors", skipped)
            return None
        if s > MAX_STEP:
            self._bad(f"step {s}: above the largest accepted step 2**53 - 1; not fed to "
                      "detectors", skipped)
            return None
        if s <= self.last_step:
            self._bad(f"step {s}: not after the last observed step {self.last_step} "
                      "(duplicate or out of order); not fed to detectors", skipped)
            return None
        return s

    def _key_plan(self, keys: list[Any]) -> KeyPlan:
        """Slots of the metric names ``keys``, cached for the two most recent key layouts."""
        plans = self._key_plans
        for plan in plans:
            if plan.keys == keys:
                if plan is not plans[0]:
                    plans.reverse()
                return plan
        slots = [self._lookup(k) for k in keys]
        ok = not slots or min(slots) >= 0
        n = len(slots)
        rng = (slice(slots[0], slots[0] + n) if n and ok and
               slots == list(range(slots[0], slots[0] + n)) else None)
        buf = array("d", bytes(8 * n))
        plan = KeyPlan(keys, np.array(slots, dtype=np.int64), ok, rng, b"\x01" * n,
                       struct.Struct(f"{n}d").pack_into, buf, np.frombuffer(buf))
        self._key_plans = [plan] + plans[:1]
        return plan

    def _fill(self, metrics: Mapping[Any, Any], skipped: list[str]) -> None:
        keys = [*metrics]
        plans = self._key_plans
        plan = plans[0] if plans and plans[0].keys == keys else self._key_plan(keys)
        values = metrics.values()
        if plan.valid and _PLAIN.issuperset(map(type, values)):
            buf = plan.buf
            try:  # fast path: plain Python / NumPy real numbers only (as ``float()`` converts
                plan.pack(buf, 0, *values)  # them; a failure leaves the slots untouched)
            except (TypeError, ValueError, OverflowError, struct.error):
                pass
            else:
                rng = plan.block
                if rng is not None:
                    self._vals_mv[rng] = buf
                    self._present_mv[rng] = plan.ones
                else:
                    self._vals[plan.slots] = plan.arr
                    self._present[plan.slots] = True
                return
        vals, present, slots = self._vals, self._present, plan.slots
        for k, v, s in zip(keys, values, slots.tolist(), strict=True):
            if s == _SCRATCH or v is None:
                continue
            if s < 0:
                self._bad(f"metrics[{k!r}]: metric names must be strings; skipped" if s != _CAPPED
                          else f"metrics[{k!r}]: every binding it matches holds max_series="
                          f"{self.max_series} series; skipped", skipped, capped=s == _CAPPED)
                continue
            x = to_float(v)
            if isinstance(x, str):
                self._bad(f"metrics[{k!r}]: {x}; skipped", skipped)
                continue
            vals[s] = x
            present[s] = True

    def _fam_plan(self, names: tuple[str, ...]) -> FamilyPlan | None:
        """The :class:`FamilyPlan` when the families ``names`` fill one contiguous slot block."""
        lo = hi = -1
        shapes, spans = [], []
        for name in names:
            fam = self._families.get(name)
            if fam is None or fam.block is None or (hi >= 0 and fam.block.start != hi):
                return None
            if lo < 0:
                lo = fam.block.start
            hi = fam.block.stop
            shapes.append((len(fam.layers),))
            spans.append(fam.block)
        return FamilyPlan(lo, hi, shapes, spans, b"\x01" * (hi - lo),
                          slice(lo, hi)) if lo >= 0 else None

    def _fill_families(self, families: Mapping[str, Any], skipped: list[str]) -> None:
        # fast path: all given families at once if they fill one contiguous block: float64
        # arrays of the declared shapes are copied straight in (memoryview), others converted
        # by one ``concatenate``; anything else goes through the checked path below
        names = tuple(families)
        plan = self._fam_plans.get(names, _NO_PLAN)
        if plan is _NO_PLAN:
            plan = self._fam_plans[names] = self._fam_plan(names)
        if plan is not None:
            vmv = self._vals_mv
            try:  # the exact format and shape, or an exception (nothing half-written is used)
                for sl, a in zip(plan.spans, families.values(), strict=True):
                    vmv[sl] = a
            except Exception:  # e.g. float32, a list, a torch tensor: convert
                arrs = tuple(families.values())
                try:
                    if [a.shape for a in arrs] != plan.shapes:
                        raise ValueError("shapes")
                    np.concatenate(arrs, out=self._vals[plan.block], casting="same_kind")
                except Exception:  # anything unusual goes through the checked path
                    plan = None
            if plan is not None:
                self._present_mv[plan.block] = plan.ones
                return
        vals, present = self._vals, self._present
        for name, arr in families.items():
            fam = self._families.get(name)
            if fam is None:
                self._bad(f"families[{name!r}]: not declared (call declare_family first); "
                          "skipped", skipped)
                continue
            if arr is None:
                continue
            layers, slots, contig = fam
            if type(arr) is np.ndarray and arr.dtype.char == "d" and arr.shape == slots.shape:
                a = arr
            else:
                try:
                    a = np.asarray(arr)
                    if a.dtype.kind not in "fiub":
                        raise TypeError(f"dtype {a.dtype} is not numeric")
                    a = a.astype(np.float64, copy=False)
                except Exception as exc:  # any conversion failure is a bad value
                    self._bad(f"families[{name!r}]: cannot convert ({exc}); skipped", skipped)
                    continue
                if a.shape != (len(layers),):
                    self._bad(f"families[{name!r}]: shape {a.shape}; expected ({len(layers)},); "
                              "skipped", skipped)
                    continue
            if contig is not None:
                vals[contig] = a
                present[contig] = True
            else:
                vals[slots] = a
                present[slots] = True
