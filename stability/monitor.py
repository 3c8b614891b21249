"""The monitor: metrics in, alarms + interventions + :class:`~stability.types.Control` out.

One :class:`Monitor` holds one detector bank per ``[[detectors]]`` binding of its config.  Each
``observe()`` writes the step's values into a slot vector, gathers every binding's
``(1, n_inputs, n_series)`` input in one Numba call and makes ONE kernel call per binding
(``update_array``); :meth:`Monitor.replay` runs each bank's ``update_many`` once over a whole
recorded run and gives identical decisions.

Input handling (documented policy, all tested):

* **values** -- floats, ints, NumPy scalars / size-1 arrays, anything with ``__float__`` or
  ``__array__`` (torch tensors work without importing torch).  ``None`` means *not logged* on this
  step (missing, never NaN).  Strings, booleans, wrong shapes and other objects are recorded in
  ``Decision.skipped`` (``ValueError`` in strict mode) and never reach a detector, and so are
  complex numbers (NumPy or torch), meta tensors and objects whose conversion raises.
* **NaN / inf** -- real observations: the ``nonfinite`` binding alarms (critical) and the other
  detectors' alarms on that same signal are suppressed on that step, so one NaN is one alarm.
* **names** -- normalised through aliases; names no binding matches are ignored (``unbound``);
  new layers grow the banks (see :mod:`stability.binding`) up to ``[monitor] max_series``
  series per bank (default 4096): a new name past a full bank is not added to it (one warning
  per bank); if no bank takes it, each of its observations is skipped (recorded).
* **families** -- a mapping of declared family name -> per-layer array; anything else is
  skipped (recorded).
* **steps** -- must be ints in ``[0, 2**53)`` (integer-valued floats are accepted) and
  increase; a step out of that range is skipped (recorded) and never becomes the last step.
  A step ``<=`` the last observed one (duplicate or out of order) is not fed to the
  detectors: the decision only lists the reason in ``skipped``.  After a
  :class:`~stability.types.Rollback` (or :meth:`Monitor.rewind`) the counter restarts at the
  rollback target, so the replayed steps are accepted.

``log_only`` (dry run): the policy decides and interventions are recorded, but the returned
``Control`` stays neutral.

Examples
--------
>>> mon = Monitor({"detectors": [
...     {"name": "nan", "detector": "nonfinite", "inputs": ["*"]},
...     {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"],
...      "params": {"warmup": 5, "alpha": 0.1}}]})
>>> for s in range(20):
...     d = mon.observe(s, {"loss": 2.0 + 0.01 * (s % 3), "lr": 1e-3})
>>> d.healthy
True
>>> [(a.kind, a.signal, a.severity) for a in mon.observe(20, {"loss": 40.0}).alarms]
[('loss_spike', 'loss', 'critical')]
>>> [(a.kind, a.signal) for a in mon.observe(21, {"loss": float("nan")}).alarms]
[('nonfinite', 'loss')]
>>> mon.observe(21, {"loss": 2.0}).skipped
('step 21: not after the last observed step 21 (duplicate or out of order); not fed to detectors',)
"""

from __future__ import annotations

import collections
import logging
import math
import warnings
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ._state_check import Fields
from .binding import Aliases, Pattern, empty_buffers, gather_step
from .config import ConfigSource, DetectorSpec, MonitorConfig, load_config
from .monitor_io import decode_state, encode_state, table_columns, to_float
from .policy import Policy
from .registry import make_detector
from .types import Alarm, Alert, Control, Decision, Intervention, Rollback

__all__ = ["Monitor", "STATE_VERSION"]

logger = logging.getLogger("stability.monitor")

STATE_VERSION = 1
GRAD_HISTORY = 100
#: Default seconds per step for all handler and sink calls (``[monitor] handler_budget_s``).
HANDLER_TIMEOUT = 1.0
#: Steps must be integers in ``[0, MAX_STEP]`` (exactly representable as float64).
MAX_STEP = 2**53 - 1
_CAPPED = -2  # _lookup: a name every matching bank refused (series cap)
_FROM_CONFIG: Any = object()
_ABSENT, _SCRATCH = 0, 1
_NF_NAMES = {1.0: "NaN", 2.0: "+inf", 3.0: "-inf"}
#: (keys in order, their slots, all keys valid, contiguous slot range or None)
_KeyPlan = tuple[list[Any], np.ndarray, bool, "slice | None"]
#: value types the fast path converts with ``array("d", ...)`` (real numbers, no ``__float__``
#: surprises: NumPy complex would silently lose its imaginary part there)
_PLAIN = frozenset({float, int, bool, np.float64, np.float32, np.float16, np.int64, np.int32,
                    np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8, np.bool_})


def _make_policy(cfg: Mapping[str, Any]) -> Policy:
    return Policy(dict(cfg))


def _new_control(src: Control) -> Control:
    c = object.__new__(Control)
    c.__dict__.update(src.__dict__)
    return c


def _decision(step: int, alarms: tuple[Alarm, ...], ivs: tuple[Intervention, ...],
              control: Control, skipped: tuple[str, ...]) -> Decision:
    d = object.__new__(Decision)
    d.__dict__.update(step=step, alarms=alarms, interventions=ivs, control=control,
                      skipped=skipped)
    return d


class _Binding:
    """Runtime side of one ``[[detectors]]`` entry: patterns, series, slots, detector, views."""

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
        self.X: Any = None
        self.M: Any = None
        self.S: Any = None
        self.A: Any = None

    def add_series(self, key: str) -> int:
        i = len(self.keys)
        self.keys.append(key)
        self.key_index[key] = i
        for col in self.slots:
            col.append(_ABSENT)
        return i


class Monitor:
    """Online training monitor (see the module docstring for the input policy).

    Parameters
    ----------
    config
        Preset name, ``.toml`` / ``.json`` path, dict or :class:`MonitorConfig`; ``None`` uses
        the ``default`` preset.
    event_log
        Optional :class:`~stability.events.EventLog`: every alarm and intervention is appended
        (default: the config's ``[event_log]``, none without a path).
    alert_sinks
        Alert sinks (or an :class:`~stability.alerts.AlertRouter`): every
        :class:`~stability.types.Alert` intervention is sent to them (default: the config's
        ``[alerts]`` -- a Python-logging sink unless ``log = false``; ``[]`` for none).
    on_alarm, on_intervention
        Optional handlers (one callable or a list); failures are contained unless strict.
    handler_timeout
        Seconds per step shared by every handler and alert-sink call of that step (default: the
        config's ``[monitor] handler_budget_s``, 1.0).  Calls run on one worker thread; a call
        that runs out of time is reported once and its handler is not called again until it
        returns (see :mod:`stability.handlers`).  ``None`` runs them inline without a limit.
    checkpoints
        A :class:`~stability.checkpoints.CheckpointLedger` (a fresh one by default), passed to
        the policy as ``context["healthy_checkpoints"]``.
    """

    def __init__(self, config: ConfigSource = None, *, event_log: Any = None,
                 alert_sinks: Any = None, on_alarm: Any = None, on_intervention: Any = None,
                 checkpoints: Any = None,
                 handler_timeout: float | None = _FROM_CONFIG) -> None:
        self.config: MonitorConfig = load_config(config)
        self.log_only = self.config.monitor.log_only
        self.strict = self.config.monitor.strict
        self._alias = Aliases(self.config.monitor.aliases)
        self._bindings = [
            _Binding(s, f"detectors[{i}]") for i, s in enumerate(self.config.detectors)
        ]
        self.policy = _make_policy(self.config.policy)
        from .alerts import event_log_from_config, sinks_from_config  # noqa: PLC0415
        # config-driven by default: a logging sink unless ``[alerts] log = false``, and the
        # ``[event_log]`` file when one is configured; explicit arguments win
        self.event_log = event_log if event_log is not None else event_log_from_config(
            self.config)
        if alert_sinks is None:
            alert_sinks = sinks_from_config(self.config)
        self.alert_sinks = list(alert_sinks) if isinstance(alert_sinks, (list, tuple)) else [
            alert_sinks]
        from .handlers import HandlerRegistry  # noqa: PLC0415
        if handler_timeout is _FROM_CONFIG:
            handler_timeout = self.config.monitor.handler_budget_s
        self.max_series = self.config.monitor.max_series
        self._capped_banks: set[str] = set()
        self.handlers = HandlerRegistry(strict=self.strict, timeout=handler_timeout)
        self._sink_failed: set[int] = set()
        for fn in _as_list(on_alarm):
            self.handlers.on_alarm(fn)
        for fn in _as_list(on_intervention):
            self.handlers.on_intervention(fn)
        if checkpoints is None:
            from .checkpoints import CheckpointLedger  # noqa: PLC0415
            checkpoints = CheckpointLedger()
        self.checkpoints = checkpoints
        #: the trainer's own gradient clip (adapters set it); the policy never loosens it
        self.trainer_clip_norm: float | None = None
        self._reset_runtime()

    # ------------------------------------------------------------------ setup helpers
    def _reset_runtime(self) -> None:
        self.control = Control()
        self._policy_control = Control() if self.log_only else self.control
        self._policy_dirty = False
        self._slot_names: list[str] = ["<absent>", "<scratch>"]
        self._slot_of: dict[str, int] = {}
        self._cache: dict[Any, int] = {}
        self.unbound: set[str] = set()
        self._families: dict[str, tuple[list[str], np.ndarray, slice | None]] = {}
        self._fam_plans: dict[tuple[str, ...], tuple[int, int, list[tuple[int]]] | None] = {}
        self._vals, self._present = empty_buffers(64)
        # the two most recent key layouts of ``metrics`` (e.g. with and without val_loss)
        self._key_plans: list[_KeyPlan] = []
        self._dirty = True
        self._ctrl_dirty = False        # self.control may hold per-step requests
        self._snap: Control | None = None  # copy of self.control shared by quiet decisions
        self._call_sets: dict[bytes, list[tuple[Any, Any, Any]]] = {}
        self._grad_slot = 0
        self._lr_slot = 0
        self._loss_slot = 0
        self._val_slot = 0
        self._lr_now: float | None = None    # requested LR of the latest step that had one
        self._lr_prev: float | None = None   # ... and of the one before
        self._grad_hist: collections.deque[float] = collections.deque(maxlen=GRAD_HISTORY)
        self._grad_last: float | None = None
        self.last_step = -1
        self.counters = {"steps": 0, "skipped_steps": 0, "skipped_values": 0, "alarm_steps": 0,
                         "alarms": 0, "interventions": 0, "sink_errors": 0}

    # ------------------------------------------------------------------ public helpers
    def on_alarm(self, fn: Any) -> Any:
        """Register ``fn(alarm)`` (decorator-friendly); failures contained unless strict."""
        return self.handlers.on_alarm(fn)

    def on_intervention(self, fn: Any) -> Any:
        """Register ``fn(intervention)``; failures contained unless strict."""
        return self.handlers.on_intervention(fn)

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

    def rewind(self, step: int) -> None:
        """Accept steps after ``step`` again (the trainer resumed from an earlier checkpoint).

        Detector statistics are kept (load a saved :meth:`state_dict` to restore them too),
        except those of step-to-step *jump* detectors (``lr_jump`` on the LR or the weight
        norm): a restore legitimately moves the LR and the weights back, which is not a jump.
        """
        self.last_step = int(step)
        guard = getattr(self.policy, "guard", None)
        if guard is not None:
            guard.rewind()  # the scheduler went back too: not an LR jump
        for b in self._bindings:
            if b.spec.detector == "lr_jump":
                b.det.reset()
                self._dirty = True  # reset() reallocates the arrays the fast path is bound to

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
            self._vals, self._present = vals, present
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
        self._families[name] = (layers, slots, contig)
        self._fam_plans.clear()

    @property
    def families(self) -> dict[str, list[str]]:
        """Declared families and their layer order."""
        return {k: list(v[0]) for k, v in self._families.items()}

    def _relayout(self) -> None:
        bs = self._bindings
        sizes = [b.n_inputs * len(b.keys) for b in bs]
        boff = np.zeros(len(bs) + 1, dtype=np.int64)
        soff = np.zeros(len(bs) + 1, dtype=np.int64)
        boff[1:] = np.cumsum(sizes)
        soff[1:] = np.cumsum([len(b.keys) for b in bs])
        gidx = np.zeros(int(boff[-1]), dtype=np.int64)
        x_all = np.zeros(int(boff[-1]))
        m_all = np.ones(int(boff[-1]), dtype=np.bool_)
        s_all = np.full(int(soff[-1]), np.nan)
        a_all = np.zeros(int(soff[-1]), dtype=np.bool_)
        calls = []
        for k, b in enumerate(bs):
            n, lo, hi = len(b.keys), int(boff[k]), int(boff[k + 1])
            if n:
                gidx[lo:hi] = np.asarray(b.slots, dtype=np.int64).reshape(-1)
            b.X = x_all[lo:hi].reshape(1, b.n_inputs, n)
            b.M = m_all[lo:hi].reshape(1, b.n_inputs, n)
            so, se = int(soff[k]), int(soff[k + 1])
            s_all[so:se] = b.det._score1[0]
            a_all[so:se] = b.det._alarm1[0]
            # the bank writes its outputs straight into the monitor's shared vectors
            b.S = b.det._score1 = s_all[so:se].reshape(1, n)
            b.A = b.det._alarm1 = a_all[so:se].reshape(1, n)
            calls.append((b.det.update_array, b.X, b.M))
        self._gather = (gidx, boff, soff, x_all, m_all, s_all, a_all,
                        np.zeros(len(bs), dtype=np.bool_))
        self._calls = calls
        self._call_sets = {}
        self._dirty = False

    def _active_calls(self, active: np.ndarray) -> list[tuple[Any, Any, Any]]:
        """The bank updates of the bindings flagged in ``active`` (cached per pattern)."""
        key = active.tobytes()
        calls = self._call_sets.get(key)
        if calls is None:
            calls = [c for c, on in zip(self._calls, active.tolist(), strict=True) if on]
            self._call_sets[key] = calls
        return calls

    # ------------------------------------------------------------------ input
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

    def _key_plan(self, metrics: Mapping[Any, Any]) -> _KeyPlan:
        """Slots of ``metrics``' keys, cached for the two most recent key layouts."""
        keys = list(metrics)
        plans = self._key_plans
        for plan in plans:
            if plan[0] == keys:
                if plan is not plans[0]:
                    plans.reverse()
                return plan
        slots = [self._lookup(k) for k in keys]
        ok = not slots or min(slots) >= 0
        n = len(slots)
        rng = (slice(slots[0], slots[0] + n) if n and ok and
               slots == list(range(slots[0], slots[0] + n)) else None)
        plan = (keys, np.array(slots, dtype=np.int64), ok, rng)
        self._key_plans = [plan] + plans[:1]
        return plan

    def _fill(self, metrics: Mapping[Any, Any], skipped: list[str]) -> None:
        keys, slots, ok, rng = self._key_plan(metrics)
        vals, present = self._vals, self._present
        values = list(metrics.values())
        if ok and _PLAIN.issuperset(map(type, values)):
            try:  # fast path: plain Python / NumPy real numbers only
                buf = np.frombuffer(array("d", values), dtype=np.float64)
            except (TypeError, ValueError, OverflowError):
                pass
            else:
                idx = rng if rng is not None else slots
                vals[idx] = buf
                present[idx] = True
                return
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

    def _fam_plan(self, names: tuple[str, ...]) -> tuple[int, int, list[tuple[int]]] | None:
        """``(lo, hi, shapes)`` when the families ``names`` fill one contiguous slot block."""
        lo = hi = -1
        shapes = []
        for name in names:
            fam = self._families.get(name)
            if fam is None or fam[2] is None or (hi >= 0 and fam[2].start != hi):
                return None
            if lo < 0:
                lo = fam[2].start
            hi = fam[2].stop
            shapes.append((len(fam[0]),))
        return (lo, hi, shapes) if lo >= 0 else None

    def _fill_families_fast(self, families: Mapping[str, Any]) -> bool:
        """All given families at once (one ``concatenate`` into the slot vector) if possible."""
        names = tuple(families)
        if names in self._fam_plans:
            plan = self._fam_plans[names]
        else:
            plan = self._fam_plans[names] = self._fam_plan(names)
        if plan is None:
            return False
        lo, hi, shapes = plan
        arrs = tuple(families.values())
        try:
            if [a.shape for a in arrs] != shapes:
                return False
            np.concatenate(arrs, out=self._vals[lo:hi], casting="same_kind")
        except Exception:  # noqa: BLE001 -- anything unusual goes through the checked path
            return False
        self._present[lo:hi] = True
        return True

    def _fill_families(self, families: Mapping[str, Any], skipped: list[str]) -> None:
        if self._fill_families_fast(families):
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
                except Exception as exc:  # noqa: BLE001 -- any conversion failure is a bad value
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

    # ------------------------------------------------------------------ the step
    def observe(self, step: int, metrics: Mapping[str, Any] | None = None,
                families: Mapping[str, Any] | None = None) -> Decision:
        """Feed one step's metrics; returns the :class:`~stability.types.Decision`.

        Parameters
        ----------
        step
            Training step (int >= 0, increasing).
        metrics
            Name -> value (see the module docstring for accepted values).
        families
            Declared family name -> array of per-layer values (fast path).
        """
        skipped: list[str] = []
        if self._ctrl_dirty:
            self.control.reset_step()
            self._ctrl_dirty = False
            self._snap = None
        if type(step) is int and self.last_step < step <= MAX_STEP:
            s = step
        else:
            s = self._check_step(step, skipped)  # type: ignore[assignment]
            if s is None:
                self.counters["skipped_steps"] += 1
                st = int(step) if isinstance(step, (int, np.integer)) else -1
                return _decision(st, (), (), self._snapshot(), tuple(skipped))
        if metrics is not None:
            if isinstance(metrics, Mapping):
                if metrics:
                    self._fill(metrics, skipped)
            else:
                self._bad(f"metrics: expected a mapping; got {type(metrics).__name__}", skipped)
        if families is not None:
            if isinstance(families, Mapping):
                if families:
                    self._fill_families(families, skipped)
            else:
                self._bad(f"families: expected a mapping of family name -> array; got "
                          f"{type(families).__name__}", skipped)
        if self._dirty:
            self._relayout()
        g = self._grad_slot
        gnow = float(self._vals[g]) if g and self._present[g] else None
        tivs = self._track(s, self._vals, self._present)  # before gather_step clears them
        gidx, boff, soff, x_all, m_all, s_all, a_all, active = self._gather
        gather_step(self._vals, self._present, gidx, boff, soff, x_all, m_all, s_all, a_all,
                    active)
        for update, x, m in self._active_calls(active):
            update(x, m)
        self.last_step = s
        self.counters["steps"] += 1
        if np.count_nonzero(a_all):
            alarms = self._make_alarms(s, [(b, b.S[0], b.A[0]) for b in self._bindings])
            ivs = self._policy_step(s, alarms, gnow)
        else:
            alarms = ivs = ()
            if self._policy_dirty:
                self._policy_step(s, alarms, gnow)
        if tivs:
            ivs = tivs + tuple(ivs)
        if gnow is not None and math.isfinite(gnow):
            self._grad_hist.append(gnow)
            self._grad_last = gnow
        d = _decision(s, alarms, ivs, self._snapshot(), tuple(skipped) if skipped else ())
        if alarms or ivs:
            self._emit(d)
        return d

    def _snapshot(self) -> Control:
        """Copy of :attr:`control` for a Decision, shared while the control does not change."""
        snap = self._snap
        if snap is None:
            snap = self._snap = _new_control(self.control)
        return snap

    def _policy_step(self, s: int, alarms: tuple[Alarm, ...], gnow: float | None
                     ) -> tuple[Intervention, ...]:
        pc = self._policy_control
        self._snap = None
        if alarms:
            if pc is not self.control:
                pc.reset_step()
            ivs = tuple(self.policy.step(s, alarms, pc, self._context(gnow)))
            self._policy_dirty = True
            self._ctrl_dirty = True
            if not self.log_only:
                for iv in ivs:
                    if isinstance(iv, Rollback):
                        self.last_step = min(self.last_step, iv.to_step)
            return ivs
        if self._policy_dirty:
            self.policy.step(s, (), pc, None)
            self._policy_dirty = pc.lr_factor != 1.0 or pc.clip_norm is not None
        return ()

    def _track(self, s: int, vals: np.ndarray, present: np.ndarray) -> tuple[Intervention, ...]:
        """Hand the step's requested LR and loss to the policy (LR guard, loss tracker)."""
        ls, lo, vs = self._lr_slot, self._loss_slot, self._val_slot
        lr = float(vals[ls]) if ls and present[ls] else None
        loss = float(vals[lo]) if lo and present[lo] else None
        val = float(vals[vs]) if vs and present[vs] else None
        if lr is not None:
            self._lr_prev, self._lr_now = self._lr_now, lr
        track = getattr(self.policy, "track", None)
        if track is None or (lr is None and loss is None and val is None):
            return ()
        guard = self.policy.guard
        was = guard.active
        ivs = tuple(track(s, lr, loss, self._policy_control, val))
        if ivs or was or guard.active:
            self._snap = None
            self._policy_dirty = True
        if ivs:
            self._ctrl_dirty = True  # e.g. a stop: per-step requests end with this step
        return ivs

    def rollback_failed(self, step: int, reason: str = "") -> None:
        """The trainer could not carry out the rollback requested at ``step``.

        The policy does not count it; the event log records it.
        """
        fn = getattr(self.policy, "rollback_failed", None)
        if fn is not None:
            fn(int(step))
        if self.event_log is not None:
            try:
                self.event_log.append({"type": "rollback_refused", "step": int(step),
                                       "reason": reason}, critical=True)
            except Exception:  # bookkeeping never kills the run
                logger.debug("could not record the refused rollback", exc_info=True)

    def _context(self, gnow: float | None) -> dict[str, Any]:
        ctx: dict[str, Any] = {"healthy_checkpoints": self.checkpoints}
        if self._lr_now is not None:
            ctx["lr"] = self._lr_now
        if self._lr_prev is not None:
            ctx["lr_prev"] = self._lr_prev
        if self.trainer_clip_norm is not None:
            ctx["clip_norm"] = self.trainer_clip_norm
        if gnow is not None and math.isfinite(gnow):
            ctx["grad_norm"] = gnow
        elif self._grad_last is not None:
            ctx["grad_norm"] = self._grad_last
        if self._grad_hist:
            ctx["grad_norm_recent_median"] = float(np.median(np.fromiter(
                self._grad_hist, dtype=np.float64, count=len(self._grad_hist))))
        return ctx

    def _make_alarms(self, step: int, rows: list[tuple[_Binding, Any, Any]]
                     ) -> tuple[Alarm, ...]:
        names = self._slot_names
        bad: set[str] = set()
        for b, _, a in rows:
            if b.nonfinite and a.any():
                for i in np.flatnonzero(a).tolist():
                    bad.update(names[b.slots[j][i]] for j in range(b.n_inputs)
                               if b.slots[j][i] > _SCRATCH)
        out: list[Alarm] = []
        for b, sc, a in rows:
            if not a.any():
                continue
            thr = float(b.det.threshold)
            items = []
            for i in np.flatnonzero(a).tolist():
                comps = [names[b.slots[j][i]] for j in range(b.n_inputs)
                         if b.slots[j][i] > _SCRATCH]
                if not b.nonfinite and bad.intersection(comps):
                    continue
                score = float(sc[i])
                signal = ",".join(comps) if comps else b.keys[i]
                if b.nonfinite:
                    sev = "critical"
                    msg = f"{signal} is {_NF_NAMES.get(score, 'non-finite')}"
                else:
                    sev = "critical" if (b.severity == "critical" or score > b.critical_factor * thr
                                         ) else b.severity
                    msg = f"{b.spec.detector} score {score:.4g} > {thr:.4g} on {signal}"
                items.append(Alarm(step, b.kind, signal, score, thr, sev, b.name, msg))
            items.sort(key=lambda al: al.signal)
            out.extend(items)
        return tuple(out)

    def _emit(self, d: Decision) -> None:
        self.counters["alarm_steps"] += bool(d.alarms)
        self.counters["alarms"] += len(d.alarms)
        self.counters["interventions"] += len(d.interventions)
        log = self.event_log
        hs = self.handlers
        hs.begin_step()  # one time budget for every handler and sink call of this step
        try:
            for a in d.alarms:
                if log is not None:
                    log.alarm(a)
                hs.alarm(a)
            for iv in d.interventions:
                if log is not None:
                    log.intervention(iv, log_only=self.log_only)
                if isinstance(iv, Alert):
                    for sink in self.alert_sinks:
                        self._send_alert(sink, iv)
                hs.intervention(iv)
        finally:
            hs.end_step()

    def _send_alert(self, sink: Any, alert: Alert) -> None:
        """``sink.send(alert)`` within the step's handler budget; a failure (or a sink that runs
        out of time) is logged once per sink and contained unless strict."""
        try:
            self.handlers.call(sink, sink.send, alert, f"alert sink {type(sink).__name__}")
        except Exception as e:
            self.counters["sink_errors"] += 1
            if self.strict:
                raise
            if id(sink) not in self._sink_failed:
                self._sink_failed.add(id(sink))
                logger.warning("alert sink %r failed (%s: %s); contained (strict=False). Further "
                               "failures of this sink are counted, not logged.", sink,
                               type(e).__name__, e, exc_info=e)

    # ------------------------------------------------------------------ batch replay
    def replay(self, data: Any) -> list[Decision]:
        """Replay a recorded run: identical to a loop of :meth:`observe`, much faster.

        ``data``: a pyarrow ``Table`` / ``RecordBatch``, a dict of NumPy columns (``step`` plus
        one column per metric; nulls / masked / ``None`` = not logged), or an iterable of those
        (see :meth:`replay_batches`).  Non-numeric columns are ignored.
        """
        if _is_table(data):
            return self._replay_table(data)
        return list(self.replay_batches(data))

    def replay_batches(self, batches: Iterable[Any]) -> Iterator[Decision]:
        """Replay batch after batch (bounded memory); detector state carries across batches."""
        for batch in batches:
            yield from self._replay_table(batch)

    def bind_table(self, data: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
        """Bind a whole table the way :meth:`replay` does, without running any detector.

        Returns the steps and, per binding name, the ``(T, n_inputs, n_series)`` values and
        missing mask that replay feeds to that binding's detector -- the one binder shared by
        replay and offline tuning (:func:`replay.tuning.score_table`), so tuned thresholds
        reproduce online exactly.  Steps must be strictly increasing.

        >>> mon = Monitor({"detectors": [{"name": "g", "detector": "ewma_z",
        ...                               "inputs": ["grad_norm/*"]}]})
        >>> steps, bound = mon.bind_table({"step": [0, 1], "grad_norm/a": [1.0, 2.0],
        ...                                "grad_norm/b": [3.0, 4.0]})
        >>> bound["g"][0].shape, bound["g"][0][1, 0].tolist()
        ((2, 1, 2), [2.0, 4.0])
        """
        steps, vals, pres = self._table_slots(*table_columns(data))
        if np.any(np.diff(steps) <= 0):
            raise ValueError("bind_table: steps must be strictly increasing.")
        out: dict[str, tuple[Any, Any]] = {}
        for b in self._bindings:
            idx = np.asarray(b.slots, dtype=np.int64).reshape(b.n_inputs, len(b.keys))
            out[b.name] = (vals[:, idx], ~pres[:, idx])
        return np.asarray(steps, dtype=np.int64), out

    def _table_slots(self, steps: Any, cols: list[tuple[str, Any, Any]]
                     ) -> tuple[Any, Any, Any]:
        """Steps, slot values ``(T, n_slots)`` and presence of decoded table columns (names
        bound in the order they first appear, as a live run would)."""
        firsts = []
        for ci, (_, _, p) in enumerate(cols):
            nz = np.flatnonzero(p)
            if nz.size:
                firsts.append((int(nz[0]), ci))
        for _, ci in sorted(firsts):
            self._lookup(cols[ci][0])
        if self._dirty:
            self._relayout()
        t_len, n_slots = len(steps), len(self._slot_names)
        vals = np.zeros((t_len, n_slots))
        pres = np.zeros((t_len, n_slots), dtype=np.bool_)
        for name, v, p in cols:
            s = self._cache.get(name, _SCRATCH)
            if s > _SCRATCH:
                vals[p, s] = v[p]
                pres[p, s] |= True
        return steps, vals, pres

    def _replay_table(self, data: Any) -> list[Decision]:
        steps, cols = table_columns(data)
        t_len = len(steps)
        if t_len == 0:
            return []
        if (steps[0] <= self.last_step or steps[0] < 0 or np.any(np.diff(steps) <= 0)
                or steps[-1] > MAX_STEP):
            return [self.observe(int(steps[t]), {n: float(v[t]) for n, v, p in cols if p[t]})
                    for t in range(t_len)]
        steps, vals, pres = self._table_slots(steps, cols)
        outs = []
        any_alarm = np.zeros(t_len, dtype=np.bool_)
        for b in self._bindings:
            idx = np.asarray(b.slots, dtype=np.int64).reshape(b.n_inputs, len(b.keys))
            x = vals[:, idx]
            sc, al = b.det.update_many(*[x[:, j, :] for j in range(b.n_inputs)],
                                       missing=~pres[:, idx])
            any_alarm |= al.any(axis=1)
            outs.append((sc, al))
        g = self._grad_slot
        decisions = []
        for t in range(t_len):
            s = int(steps[t])
            if self._ctrl_dirty:
                self.control.reset_step()
                self._ctrl_dirty = False
                self._snap = None
            gnow = float(vals[t, g]) if g and pres[t, g] else None
            self.last_step = s
            tivs = self._track(s, vals[t], pres[t])
            if any_alarm[t]:
                alarms = self._make_alarms(s, [(b, o[0][t], o[1][t])
                                               for b, o in zip(self._bindings, outs, strict=True)])
                ivs = self._policy_step(s, alarms, gnow)
            else:
                alarms = ()
                ivs = self._policy_step(s, alarms, gnow) if self._policy_dirty else ()
            if tivs:
                ivs = tivs + tuple(ivs)
            if gnow is not None and math.isfinite(gnow):
                self._grad_hist.append(gnow)
                self._grad_last = gnow
            d = _decision(s, alarms, ivs, self._snapshot(), ())
            if alarms or ivs:
                self._emit(d)
            decisions.append(d)
        self.counters["steps"] += t_len
        return decisions

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Whole-monitor snapshot as JSON-compatible data (``json.dumps`` works, no NaN)."""
        sd = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "slots": self._slot_names[2:],
            "unbound": sorted(self.unbound),
            "families": {k: list(v[0]) for k, v in self._families.items()},
            "bindings": [{"name": b.name, "keys": list(b.keys), "slots": [list(c) for c in b.slots],
                          "detector": b.det.state_dict()} for b in self._bindings],
            "policy": self.policy.state_dict(),
            "policy_dirty": self._policy_dirty,
            "control": self.control.to_dict(),
            "policy_control": self._policy_control.to_dict(),
            "checkpoints": self.checkpoints.state_dict() if hasattr(
                self.checkpoints, "state_dict") else None,
            "last_step": self.last_step,
            "grad_history": list(self._grad_hist),
            "grad_last": self._grad_last,
            "lr_now": self._lr_now,
            "lr_prev": self._lr_prev,
            "counters": dict(self.counters),
        }
        return encode_state(sd)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore a :meth:`state_dict` snapshot; the snapshot is checked before it is used.

        Precedence: **this monitor's config wins**.  Hyperparameters (thresholds, detector
        parameters, the policy) always come from :attr:`config`, never from the snapshot; the
        snapshot contributes state only -- the signal layout, each bank's statistics, the
        policy's incident state, the control, the checkpoint ledger and the counters -- and
        only where it is compatible with this config: same bindings, the same slot layout
        (re-derived from the snapshot's signal names, never trusted as indices), detector
        arrays of the right class, shapes and dtypes with ring positions and counts in range
        and finite statistics (see :meth:`detectors.BankDetector.validate_state_dict`).

        Parameters
        ----------
        state
            Output of :meth:`state_dict` (possibly through JSON).
        strict
            ``True`` (default): any incompatible part raises ``ValueError`` naming the field,
            and the monitor is left exactly as it was.  ``False``: each incompatible part
            (the layout, one bank, the policy, the control, the ledger, the run history)
            *re-warms* -- it starts fresh -- with a ``UserWarning`` naming it; banks keep the
            statistics of the series the two layouts share.  A snapshot that is not a monitor
            snapshot at all (not a mapping, a newer version) raises in both modes.
        """
        backup = self.state_dict()
        try:
            self._load_state(state, strict)
        except Exception as exc:
            self._load_state(backup, True)  # a failed load changes nothing
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"Monitor.load_state_dict(): malformed snapshot "
                             f"({type(exc).__name__}: {exc}).") from exc

    def _load_state(self, state: Mapping[str, Any], strict: bool) -> None:
        try:
            sd = decode_state(state)
        except Exception as exc:  # noqa: BLE001 -- a hostile encoding may raise anything
            raise ValueError(f"Monitor.load_state_dict(): cannot decode the snapshot "
                             f"({type(exc).__name__}: {exc}).") from None
        f = Fields("Monitor", sd)
        f.version(STATE_VERSION)
        live = [b.name for b in self._bindings]
        snap: dict[str, Fields] = {}
        for i, bd in enumerate(f.seq("bindings")):
            g = Fields("Monitor", bd, f"bindings[{i}].")
            snap[g.text("name", max_len=1000)] = g
        if list(snap) != live:
            msg = (f"Monitor.load_state_dict(): snapshot bindings {list(snap)} do not match "
                   f"this monitor's {live}.")
            if strict:
                raise ValueError(msg)
            _rewarm(msg + " Bindings missing from the snapshot start fresh.")
        if sd.get("config") is not None and sd.get("config") != self.config.to_dict():
            logger.info("Monitor.load_state_dict(): the snapshot was taken with another config; "
                        "this monitor's config (hyperparameters) wins.")

        def part(name: str, fn: Any, fresh: Any = None) -> Any:
            try:
                return fn()
            except ValueError as exc:
                if strict:
                    raise ValueError(f"{exc} (in {name})") from None
                _rewarm(f"{exc} (in {name}) Re-warming it.")
                return fresh() if callable(fresh) else fresh

        layout = part("the signal layout", lambda: _read_layout(f), ([], [], {}))
        self._reset_runtime()
        for b in self._bindings:
            b.keys, b.key_index, b.slots = [], {}, [[] for _ in b.patterns]
            b.det.n_series = 0
            b.det.reset()
        names, unbound, families = layout
        for name in names:
            if name not in self._slot_of:
                self._bind(name)
        self.unbound |= set(unbound[: max(self.max_series - len(self.unbound), 0)])
        for fam, layers in families.items():
            part(f"family {fam!r}", lambda fam=fam, layers=layers: self.declare_family(fam, layers))
        same_names = self._slot_names[2:] == names
        for b in self._bindings:  # re-binding left every bank fresh: that is the fallback
            bd = snap.get(b.name)
            if bd is not None:
                part(f"bank {b.name!r}",
                     lambda b=b, bd=bd: self._load_bank(b, bd, same_names, strict))
        pol = f.get("policy", None)
        if pol is not None:
            part("the policy", lambda: self.policy.load_state_dict(pol),
                 lambda: getattr(self.policy, "reset", lambda: None)())
        self._policy_dirty = part("the policy flag", lambda: f.flag("policy_dirty", False), False)
        ctl = part("the control", lambda: (_read_control(f, "control"),
                                           _read_control(f, "policy_control")),
                   lambda: (Control(), Control()))
        self.control = ctl[0]
        self._ctrl_dirty = True  # per-step requests of the snapshot's step end with it
        self._snap = None
        self._policy_control = ctl[1] if self.log_only else self.control
        led = f.get("checkpoints", None)
        if led is not None and hasattr(self.checkpoints, "load_state_dict"):
            part("the checkpoint ledger", lambda: self.checkpoints.load_state_dict(led),
                 lambda: self.checkpoints.load_state_dict({"records": [], "alarms": []}))
        keys = set(self.counters)
        hist = part("the run history", lambda: _read_history(f, keys),
                    lambda: _read_history(Fields("Monitor", {}), keys))
        self.last_step, grad_hist, self._grad_last, self._lr_now, self._lr_prev, counters = hist
        self._grad_hist.extend(grad_hist)
        self.counters.update(counters)
        self._dirty = True

    def _load_bank(self, b: _Binding, g: Fields, same_names: bool, strict: bool) -> None:
        """Install one bank's snapshot: its series must be this layout's, else (not strict)
        the series both layouts share keep their statistics."""
        keys = [g.text(f"keys[{i}]", value=k, max_len=100_000)
                for i, k in enumerate(g.seq("keys"))]
        slots = g.seq("slots", b.n_inputs)
        same = same_names and keys == b.keys and all(
            isinstance(c, list) and c == b.slots[j] for j, c in enumerate(slots))
        checked = b.det.validate_state_dict(g.get("detector"))  # names the detector field
        if checked.n_series != len(keys):
            g.fail("detector", f"state for {len(keys)} series (one per key)",
                   f"{checked.n_series} series")
        if not same:
            msg = (f"Monitor.load_state_dict(): the series of bank {b.name!r} in the snapshot "
                   f"do not match the layout this config gives its signals.")
            if strict:
                raise ValueError(msg + " Pass strict=False to keep the shared series and "
                                 "re-warm the rest.")
            _rewarm(msg + " Shared series keep their statistics; the others start fresh.")
            pos = {k: i for i, k in enumerate(keys)}
            checked = b.det.select_series(checked, [pos.get(k) for k in b.keys])
        b.det.apply_state(checked)

    def __repr__(self) -> str:
        return (f"Monitor(bindings={[b.name for b in self._bindings]}, "
                f"signals={len(self._slot_names) - 2}, last_step={self.last_step})")

    def calibrate(self, data: Any) -> int:
        """Prime every detector from earlier history without alarming or acting; returns the
        number of rows fed (see :func:`stability.calibrate.calibrate`)."""
        from .calibrate import calibrate  # noqa: PLC0415
        return calibrate(self, data)


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _is_table(data: Any) -> bool:
    if isinstance(data, Mapping):
        return True
    mod = type(data).__module__
    return mod.startswith("pyarrow") and hasattr(data, "column_names")


# ---------------------------------------------------------------------- state helpers
def _rewarm(msg: str) -> None:
    warnings.warn(msg, UserWarning, stacklevel=4)


def _read_layout(f: Fields) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """The snapshot's signal names (in slot order), unbound names and families, checked."""
    names = [f.text(f"slots[{i}]", value=x, max_len=100_000)
             for i, x in enumerate(f.seq("slots", None, f.get("slots", [])))]
    if len(set(names)) != len(names):
        f.fail("slots", "a list of distinct signal names", "duplicates")
    unbound = [f.text(f"unbound[{i}]", value=x, max_len=100_000)
               for i, x in enumerate(f.seq("unbound", None, f.get("unbound", [])))]
    families: dict[str, list[str]] = {}
    for fam, layers in f.mapping("families", {}).items():
        fam = f.text("families", value=fam, max_len=100_000)
        families[fam] = [f.text(f"families.{fam}[{i}]", value=x, max_len=100_000)
                         for i, x in enumerate(f.seq(f"families.{fam}", None, layers))]
    return names, unbound, families


def _read_control(f: Fields, key: str) -> Control:
    """A :class:`Control` from the snapshot, every field checked."""
    g = f.sub(key, {})
    d: dict[str, Any] = {
        "lr_factor": g.number("lr_factor", g.get("lr_factor", 1.0), lo=0.0, low_open=True),
        "clip_norm": g.opt_number("clip_norm", lo=0.0, low_open=True),
        "rollback_to": g.opt_integer("rollback_to", lo=0),
    }
    for k in ("skip_step", "save_checkpoint", "stop"):
        d[k] = g.flag(k, False)
    for k in ("checkpoint_reason", "stop_reason"):
        d[k] = g.text(k, "")
    sb = g.opt_seq("skip_batches", 2)
    if sb is not None:
        lo, hi = g.integer("skip_batches[0]", sb[0]), g.integer("skip_batches[1]", sb[1])
        if hi < lo:
            g.fail("skip_batches", "[first, last] with first <= last", sb)
        d["skip_batches"] = (lo, hi)
    return Control.from_dict(d)


def _read_history(f: Fields, counter_keys: set[str]) -> tuple[
        int, list[float], float | None, float | None, float | None, dict[str, int]]:
    """last_step, gradient-norm history, last gradient norm, LRs and counters, checked."""
    last_step = f.integer("last_step", f.get("last_step", -1), lo=-1)
    gh = f.seq("grad_history", None, f.get("grad_history", []))[-GRAD_HISTORY:]
    grad_hist = [f.number(f"grad_history[{i}]", x) for i, x in enumerate(gh)]
    grad_last = f.opt_number("grad_last")
    lr_now = f.opt_number("lr_now", nan=True, inf=True)
    lr_prev = f.opt_number("lr_prev", nan=True, inf=True)
    counters = {k: f.integer(f"counters.{k}", v, lo=0)
                for k, v in f.mapping("counters", {}).items() if k in counter_keys}
    return last_step, grad_hist, grad_last, lr_now, lr_prev, counters

