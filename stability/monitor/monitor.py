"""The monitor: metrics in, alarms + interventions + :class:`~stability.types.Control` out.

One :class:`Monitor` holds one detector bank per ``[[detectors]]`` binding of its config.  Each
``observe()`` writes the step's values into a slot vector and makes ONE Numba call that gathers
every bank's input and updates every bank (:mod:`stability.monitor.fused`); :meth:`Monitor.replay`
runs each bank's ``update_many`` once over a whole recorded run: identical decisions.

Input handling (documented policy, all tested):

* **values** -- floats, ints, NumPy scalars / size-1 arrays, anything with ``__float__`` or
  ``__array__`` (torch tensors work without importing torch).  ``None`` means *not logged* on this
  step (missing, never NaN).  Strings, booleans, wrong shapes and other objects are recorded in
  ``Decision.skipped`` (``ValueError`` in strict mode) and never reach a detector, and so are
  complex numbers (NumPy or torch), meta tensors and objects whose conversion raises.
* **NaN / inf** -- real observations: the ``nonfinite`` binding alarms (critical) and the other
  detectors' alarms on that same signal are suppressed on that step, so one NaN is one alarm.
* **names** -- normalised through aliases; names no binding matches are ignored (``unbound``);
  new layers grow the banks (see :mod:`stability.monitor.binding`) up to ``[monitor] max_series``
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
>>> print(mon.observe(21, {"loss": 2.0}).skipped[0])  # doctest: +ELLIPSIS
step 21: not after the last observed step 21 (duplicate or out of order; ...) ...
"""

from __future__ import annotations

import collections
import functools
import gc
import logging
import math
import struct
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import stability.monitor.replay as table_replay
from detectors.dispatch import compiling
from stability._state_check import Fields
from stability.config.config import ConfigSource, MonitorConfig, load_config
from stability.monitor.binding import Aliases, OwnNames, empty_buffers
from stability.monitor.bound import BoundInputs, resolve_slots
from stability.monitor.decisions import Decisions
from stability.monitor.emit import NF_NAMES, new_decision
from stability.monitor.fused import (
    N_TRACKED,
    FusedPlan,
    build_fused_plan,
    fused_step,
    reference_step,
    step_buffers,
)
from stability.monitor.io import (
    decode_state,
    encode_state,
    is_table,
    to_float,
    value_kind,
    value_message,
)
from stability.monitor.layout import (
    CAPPED,
    MAX_STEP,
    NO_PLAN,
    PLAIN_TYPES,
    SCRATCH,
    Binding,
    Family,
    FamilyPlan,
    GatherPlan,
    KeyPlan,
)
from stability.monitor.recovery import RecoveryTracker
from stability.monitor.replay import Column, decode_table, merge_columns
from stability.monitor.replay_fill import Block, Feeds, GuardChunks, feed_sig
from stability.monitor.replay_fill import fill_bank as _fill_bank
from stability.monitor.state import (
    GRAD_HISTORY,
    STATE_VERSION,
    PartLoader,
    checked_goodput,
    read_control,
    read_history,
    read_layout,
    rewarm,
)
from stability.policy.context import PolicyContext
from stability.policy.policy import Policy
from stability.run.checkpoints import CheckpointLedger
from stability.run.goodput import GoodputTracker
from stability.types import Alarm, Alert, Control, Decision, Intervention, Rollback

__all__ = ["MAX_STEP", "STATE_VERSION", "BoundInputs", "Monitor"]

logger = logging.getLogger("stability.monitor")

#: Default seconds per step for all handler and sink calls (``[monitor] handler_budget_s``).
HANDLER_TIMEOUT = 1.0
#: the guard's canary metric (:mod:`stability.adapters.guard.canary`), noted by the policy
CANARY_LOSS = "canary_loss"
_FROM_CONFIG: Any = object()


def _make_policy(cfg: Mapping[str, Any]) -> Policy:
    return Policy(dict(cfg))


def _new_control(src: Control) -> Control:
    c = object.__new__(Control)
    c.__dict__.update(src.__dict__)
    return c


class Monitor:
    """Online training monitor (see the module docstring for the input policy).

    Parameters
    ----------
    config
        Preset name, ``.toml`` / ``.json`` path, dict or :class:`MonitorConfig`; ``None`` uses
        the ``default`` preset.
    event_log
        Optional :class:`~stability.outputs.events.EventLog`: every alarm and intervention is
        appended
        (default: the config's ``[event_log]``, none without a path).
    alert_sinks
        Alert sinks (or an :class:`~stability.outputs.alerts.AlertRouter`): every
        :class:`~stability.types.Alert` intervention is sent to them (default: the config's
        ``[alerts]`` -- a Python-logging sink unless ``log = false``; ``[]`` for none).
    on_alarm, on_intervention
        Optional handlers (one callable or a list); failures are contained unless strict.
    handler_timeout
        Seconds per step shared by every handler and alert-sink call of that step (default: the
        config's ``[monitor] handler_budget_s``, 1.0).  Calls run on one worker thread; a call
        that runs out of time is reported once and its handler is not called again until it
        returns (see :mod:`stability.outputs.handlers`).  ``None`` runs them inline without a limit.
    checkpoints
        A :class:`~stability.run.checkpoints.CheckpointLedger` (a fresh one by default), passed to
        the policy as ``context["healthy_checkpoints"]``.
    goodput
        The run's :class:`~stability.run.goodput.GoodputTracker` (by default a fresh one that
        counts steps only until :meth:`~stability.run.goodput.GoodputTracker.start` is called --
        the trainer adapters do -- so replays stay deterministic; pass one to share it, e.g.
        with the :class:`~stability.run.watchdog.StallWatchdog`).  Every step --
        live or replayed -- is counted from the :class:`~stability.types.Control` the monitor
        returns (:meth:`~stability.run.goodput.GoodputTracker.update_from_control`); a requested
        rollback is counted there, and an adapter that performs it replaces that count with
        the one it really did (:meth:`~stability.run.goodput.GoodputTracker.rollback_done`).  The
        ledger is part of :meth:`state_dict` and is appended to the event log every
        ``[event_log] goodput_every`` steps and by :meth:`close`.

    Notes
    -----
    One class, in sections: the step (:meth:`observe`), the slot layout (data types in
    :mod:`stability.monitor.layout`), emitting (:mod:`stability.monitor.emit`), batch replay
    (table decoding in :mod:`stability.monitor.replay`), snapshots (field readers in
    :mod:`stability.monitor.state`) and bound inputs (:meth:`bind_inputs` /
    :meth:`observe_bound`, :class:`~stability.monitor.bound.BoundInputs`).  :meth:`observe`,
    :meth:`observe_bound` and :meth:`replay` end every step with the same :meth:`_finish_step`.
    """

    def __init__(self, config: ConfigSource = None, *, event_log: Any = None,
                 alert_sinks: Any = None, on_alarm: Any = None, on_intervention: Any = None,
                 checkpoints: CheckpointLedger | None = None,
                 handler_timeout: float | None = _FROM_CONFIG,
                 goodput: GoodputTracker | None = None) -> None:
        self.config: MonitorConfig = load_config(config)
        self.log_only = self.config.monitor.log_only
        self.strict = self.config.monitor.strict
        self._alias = Aliases(self.config.monitor.aliases)
        self._own = OwnNames(self.config.monitor.own_prefixes)
        self._bindings = [
            Binding(s, f"detectors[{i}]") for i, s in enumerate(self.config.detectors)
        ]
        self.policy = _make_policy(self.config.policy)
        from stability.outputs.alerts import event_log_from_config, sinks_from_config
        # config-driven by default: a logging sink unless ``[alerts] log = false``, and the
        # ``[event_log]`` file when one is configured; explicit arguments win
        self._owns_event_log = event_log is None  # close() closes only what it opened
        self.event_log = event_log if event_log is not None else event_log_from_config(
            self.config)
        # steps only until a trainer adapter starts its clock: replays stay deterministic
        self.goodput = goodput if goodput is not None else GoodputTracker(auto_start=False)
        self.goodput_every = self.config.event_log.goodput_every
        self._closed = False
        self._owns_sinks = alert_sinks is None
        if alert_sinks is None:
            alert_sinks = sinks_from_config(self.config)
        self.alert_sinks = list(alert_sinks) if isinstance(alert_sinks, (list, tuple)) else [
            alert_sinks]
        from stability.outputs.handlers import HandlerRegistry
        if handler_timeout is _FROM_CONFIG:
            handler_timeout = self.config.monitor.handler_budget_s
        self.max_series = self.config.monitor.max_series
        self._capped_banks: set[str] = set()
        self._warned_kinds: set[str] = set()  # kinds of bad input warned about (once each)
        self.handlers = HandlerRegistry(strict=self.strict, timeout=handler_timeout)
        self._sink_failed: set[int] = set()
        for fn in _as_list(on_alarm):
            self.handlers.on_alarm(fn)
        for fn in _as_list(on_intervention):
            self.handlers.on_intervention(fn)
        if checkpoints is None:
            checkpoints = CheckpointLedger()
        self.checkpoints = checkpoints
        self.policy.ledger = checkpoints  # the policy's rollback targets between alarm steps
        #: the trainer's own gradient clip (adapters set it); the policy never loosens it
        self.trainer_clip_norm: float | None = None
        self._reset_runtime()

    # ------------------------------------------------------------------ setup helpers
    def _reset_runtime(self) -> None:
        self.control = Control()
        self._policy_control = Control() if self.log_only else self.control
        self._policy_dirty = False
        self._reset_layout()
        self._ctrl_dirty = False        # self.control may hold per-step requests
        self._snap: Control | None = None  # copy of self.control shared by quiet decisions
        self._lr_now: float | None = None    # requested LR of the latest step that had one
        self._lr_prev: float | None = None   # ... and of the one before
        self._grad_hist: collections.deque[float] = collections.deque(maxlen=GRAD_HISTORY)
        self._grad_last: float | None = None
        self.last_step = -1
        #: step of the stop the policy decided (``None``: running); a stop is decided once
        self.stopped_at: int | None = None
        self.counters = {"steps": 0, "skipped_steps": 0, "skipped_values": 0, "alarm_steps": 0,
                         "alarms": 0, "interventions": 0, "sink_errors": 0}
        self._recovery = RecoveryTracker()  # peak score per alarming (binding, signal)

    # ------------------------------------------------------------------ public helpers
    def on_alarm(self, fn: Any) -> Any:
        """Register ``fn(alarm)`` (decorator-friendly); failures contained unless strict."""
        return self.handlers.on_alarm(fn)

    def on_intervention(self, fn: Any) -> Any:
        """Register ``fn(intervention)``; failures contained unless strict."""
        return self.handlers.on_intervention(fn)

    def rewind(self, step: int) -> None:
        """Accept steps after ``step`` again (the trainer resumed from an earlier checkpoint).

        Detector statistics are kept (load a saved :meth:`state_dict` to restore them too),
        except those of step-to-step *jump* detectors (``lr_jump``, ``coherent_jump``): a
        restore legitimately moves the LR, the weights and their gradients back.
        """
        self.last_step = int(step)
        if self.stopped_at is not None and self.stopped_at > step:
            self.stopped_at = None  # the job re-ran from before its stop: a new stop is news
        self.policy.guard.rewind()  # the scheduler went back too: not an LR jump
        for b in self._bindings:
            if b.spec.detector in ("lr_jump", "coherent_jump"):
                b.det.reset()
                self._dirty = True  # reset() reallocates the arrays the fast path is bound to

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
                return self._skipped_step(step, skipped)
        if metrics is not None:
            if type(metrics) is dict or isinstance(metrics, Mapping):
                if metrics:
                    self._fill(metrics, skipped)
                    if CANARY_LOSS in metrics:  # (the guard's canary: where its climb began)
                        note = getattr(self.policy, "note_canary", None)
                        if note is not None:
                            note(s, metrics[CANARY_LOSS])
            else:
                self._bad(f"metrics: expected a mapping; got {type(metrics).__name__}", skipped)
        if families is not None:
            if type(families) is dict or isinstance(families, Mapping):
                if families:
                    self._fill_families(families, skipped)
            else:
                self._bad(f"families: expected a mapping of family name -> array; got "
                          f"{type(families).__name__}", skipped)
        if self._dirty:
            self._relayout()
        fused = self._fused  # capture + gather + every bank + alarm count: one native call
        if fused:
            n_alarms = fused_step(*self._fused_args)
        else:
            n_alarms = self._plain_step()
        g, lr, loss, val, g_on, lr_on, loss_on, val_on = self._tracked.tolist()
        if lr_on and loss_on and self.policy.track_quiet(s, lr, loss, val if val_on else None):
            self._lr_prev, self._lr_now = self._lr_now, lr  # _track_values: nothing requested
            tivs: tuple[Intervention, ...] = ()
        elif lr_on or loss_on or val_on:
            tivs = self._track_values(s, lr if lr_on else None, loss if loss_on else None,
                                      val if val_on else None)
        else:
            tivs = ()
        self.last_step = s
        return self._finish_step(s, self._live_rows() if n_alarms else None,
                                 g if g_on else None, tivs, tuple(skipped) if skipped else ())

    def _skipped_step(self, step: Any, skipped: list[str]) -> Decision:
        """The decision of a step that is not fed to the detectors (bad or repeated step)."""
        self.counters["skipped_steps"] += 1
        st = int(step) if isinstance(step, (int, np.integer)) else -1
        return new_decision(st, (), (), self._snapshot(), tuple(skipped))

    def _plain_step(self) -> int:
        """The step without the fused driver (:func:`reference_step`); the alarm count."""
        n_alarms = reference_step(self._vals, self._present, self._gather, self._calls,
                                  self._tslots, self._tracked)
        if self._fused_wait and not compiling():  # the background compiler is done:
            self._dirty = True  # the next step builds the fused plan
        return n_alarms

    def _finish_step(self, s: int, rows: list[tuple[Binding, Any, Any]] | None,
                     gnow: float | None, tivs: tuple[Intervention, ...],
                     skipped: tuple[str, ...]) -> Decision:
        """The per-step tail shared by :meth:`observe` and :meth:`replay` (one copy, so both
        decide bit for bit alike): alarms -> policy step -> LR-guard interventions first ->
        gradient history -> :class:`Decision` -> goodput ledger -> event log and handlers.

        ``rows`` holds each binding's ``(binding, scores, alarms)`` of step ``s`` when any bank
        alarmed (``None`` otherwise); ``tivs`` are the interventions :meth:`_track` returned.
        """
        if rows is None and not tivs and not self._policy_dirty:
            # a quiet step (the common case): the same effect as the general path below, with
            # nothing to decide -- no policy step, no emit, the shared snapshot
            if gnow is not None and math.isfinite(gnow):
                self._grad_hist.append(gnow)
                self._grad_last = gnow
            snap = self._snap
            if snap is None:
                snap = self._snapshot()
            d = new_decision(s, (), (), snap, skipped)
            self.goodput.update_from_control(s, snap)
            counters = self.counters
            counters["steps"] = n = counters["steps"] + 1
            every = self.goodput_every
            if every and n % every == 0 and self.event_log is not None:
                self._log_goodput()
            return d
        if rows is not None:
            alarms = self._make_alarms(s, rows)
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
        d = new_decision(s, alarms, ivs, self._snapshot(), skipped)
        self.goodput.update_from_control(s, d.control)
        counters = self.counters
        counters["steps"] += 1
        if alarms or ivs:
            self._emit(d)
        every = self.goodput_every
        if every and counters["steps"] % every == 0 and self.event_log is not None:
            self._log_goodput()
        return d

    def _log_goodput(self) -> None:
        """Append the goodput ledger's record to the event log (never raises)."""
        try:
            self.event_log.append(self.goodput.record())
        except Exception:  # bookkeeping never kills the run
            logger.debug("could not record the goodput ledger", exc_info=True)

    def record_goodput(self) -> None:
        """Sync the goodput ledger and append its record to the event log now (never raises).

        The trainer adapters call this at the end of ``fit``/``train`` (the monitor stays open:
        a resumed or second ``train()`` keeps using it).
        """
        if self.event_log is None or self._closed:
            return
        try:
            self.goodput.sync()
        except Exception:  # bookkeeping never kills the run
            logger.debug("could not sync the goodput ledger", exc_info=True)
        self._log_goodput()

    def close(self) -> None:
        """End of run: a final goodput record, then close what the monitor opened itself.

        The ledger is synced (time since the last step is ``other``) and appended to the event
        log.  The event log and alert sinks the monitor built from its config are closed
        (pending alerts are flushed); those passed in by the caller are left open (their owner
        closes them).
        Idempotent; also a context manager (``with Monitor(...) as mon:``).
        """
        if self._closed:
            return
        self._closed = True
        if self.event_log is not None:
            try:
                self.goodput.sync()
            except Exception:  # bookkeeping never kills the run
                logger.debug("could not sync the goodput ledger", exc_info=True)
            self._log_goodput()
            if self._owns_event_log:
                try:
                    self.event_log.close()
                except Exception:
                    logger.debug("could not close the event log", exc_info=True)
        if self._owns_sinks:
            for sink in self.alert_sinks:
                shut = getattr(sink, "close", None)  # sinks are duck-typed; close() is optional
                try:
                    if shut is not None:
                        shut()
                except Exception:
                    logger.debug("could not close alert sink %r", sink, exc_info=True)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            ivs = self._stop_once(s, tuple(self.policy.step(s, alarms, pc,
                                                            self._context(gnow))))
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
        """:meth:`_track_values` of the step's slot values (replay's per-step path)."""
        ls, lo, vs = self._lr_slot, self._loss_slot, self._val_slot
        return self._track_values(s, float(vals[ls]) if ls and present[ls] else None,
                                  float(vals[lo]) if lo and present[lo] else None,
                                  float(vals[vs]) if vs and present[vs] else None)

    def _track_values(self, s: int, lr: float | None, loss: float | None, val: float | None
                      ) -> tuple[Intervention, ...]:
        """Hand the step's requested LR and loss to the policy (LR guard, loss tracker)."""
        if lr is not None:
            self._lr_prev, self._lr_now = self._lr_now, lr
        elif loss is None and val is None:
            return ()
        guard = self.policy.guard
        was = guard.active
        ivs = self._stop_once(s, tuple(self.policy.track(s, lr, loss, self._policy_control,
                                                         val)))
        if ivs or was or guard.active:
            self._snap = None
            self._policy_dirty = True
        if ivs:
            self._ctrl_dirty = True  # e.g. a stop: per-step requests end with this step
        return ivs

    def _stop_once(self, s: int, ivs: tuple[Intervention, ...]) -> tuple[Intervention, ...]:
        """A stop is decided once.

        The first response holding a ``Stop`` marks the run stopped (:attr:`stopped_at`).  When
        steps go on after it (a log that continues past the stop in ``replay`` / ``watch``, a
        loop that ignores it), the policy's state still says stop and it answers the same stop
        again: that response is the standing stop, not a new decision -- nothing is requested
        (no ``Stop``, no second restore, no alert), and the control says only ``stop``.
        """
        if not any(iv.type == "stop" for iv in ivs):
            return ivs
        if self.stopped_at is None or s <= self.stopped_at:
            self.stopped_at = s
            return ivs
        pc = self._policy_control
        reason = pc.stop_reason
        pc.reset_step()
        pc.stop, pc.stop_reason = True, reason
        return ()

    def rollback_failed(self, step: int, reason: str = "") -> None:
        """The trainer could not carry out the rollback requested at ``step``.

        The policy and the goodput ledger do not count it; the event log records it.
        """
        self.policy.rollback_failed(int(step))
        self.goodput.cancel_rollback(int(step))
        if self.event_log is not None:
            try:
                self.event_log.append({"type": "rollback_refused", "step": int(step),
                                       "reason": reason}, critical=True)
            except Exception:  # bookkeeping never kills the run
                logger.debug("could not record the refused rollback", exc_info=True)

    def _context(self, gnow: float | None) -> PolicyContext:
        grad = gnow if gnow is not None and math.isfinite(gnow) else self._grad_last
        hist = self._grad_hist
        med = float(np.median(np.fromiter(hist, dtype=np.float64, count=len(hist)))
                    ) if hist else None
        return PolicyContext(healthy_checkpoints=self.checkpoints, lr=self._lr_now,
                             lr_prev=self._lr_prev, clip_norm=self.trainer_clip_norm,
                             grad_norm=grad, grad_norm_recent_median=med)

    def __repr__(self) -> str:
        return (f"Monitor(bindings={[b.name for b in self._bindings]}, "
                f"signals={len(self._slot_names) - 2}, last_step={self.last_step})")

    def calibrate(self, data: Any, *, resume: bool = True) -> int:
        """Prime from earlier history without acting
        (:func:`stability.monitor.calibrate.calibrate`)."""
        from stability.monitor.calibrate import calibrate
        return calibrate(self, data, resume=resume)

    # ====== the slot layout: names -> slots -> bank inputs (types: monitor.layout)
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
        self._fused: FusedPlan | None = None
        self._fused_args: tuple[np.ndarray, ...] = ()
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
            if s == CAPPED or (s == SCRATCH and len(self.unbound) >= self.max_series):
                return s  # not cached: memory stays bounded under endless new names
        self._cache[raw] = s
        return s

    def _bind(self, name: str) -> int:
        if self._own(name):  # the guard's own logs are never inputs (binding.OwnNames)
            return SCRATCH
        hits = []
        for b in self._bindings:
            for j, p in enumerate(b.patterns):
                key = p.match(name)
                if key is not None:
                    hits.append((b, j, key))
        if not hits:
            if len(self.unbound) < self.max_series:
                self.unbound.add(name)
            return SCRATCH
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
                return CAPPED
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
        slots = np.array([max(self._lookup(f"{name}/{x}"), SCRATCH) for x in layers],
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

    def _live_rows(self) -> list[tuple[Binding, Any, Any]]:
        """``(binding, scores, alarms)`` of the step just gathered, for ``_make_alarms``."""
        return [(b, b.scores[0], b.alarms[0]) for b in self._bindings]  # type: ignore[index]

    # ------------------------------------------------------------------ filling a step
    def _bad(self, msg: str, skipped: list[str], capped: bool = False, kind: str = "") -> None:
        """Record bad input in ``Decision.skipped`` (``ValueError`` in strict mode), and warn
        the first time of each ``kind`` (a run must not look monitored while nothing is)."""
        if self.strict and not capped:  # a full bank is a resource limit, not bad input
            raise ValueError(msg)
        skipped.append(msg)
        self.counters["skipped_values"] += 1
        if kind and kind not in self._warned_kinds:
            self._warned_kinds.add(kind)
            logger.warning("stability: %s (further input skipped for this reason is recorded in "
                           "Decision.skipped, not logged)", msg)

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
                      "(duplicate or out of order; after a restore from an earlier checkpoint "
                      "call Monitor.rewind(step) first); not fed to detectors", skipped,
                      kind="step order")
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
        if plan.valid and PLAIN_TYPES.issuperset(map(type, values)):
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
            if s == SCRATCH or v is None:
                continue
            if s < 0:
                self._bad(f"metrics[{k!r}]: metric names must be strings; skipped" if s != CAPPED
                          else f"metrics[{k!r}]: every binding it matches holds max_series="
                          f"{self.max_series} series; skipped", skipped, capped=s == CAPPED)
                continue
            x = to_float(v)
            if isinstance(x, str):
                self._bad(value_message(k, v, x), skipped, kind=value_kind(v, x))
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
        plan = self._fam_plans.get(names, NO_PLAN)
        if plan is NO_PLAN:
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

    # ====== emitting: event log, handlers, alert sinks
    def report_alarms(self, step: int, alarms: Sequence[Alarm]) -> Decision | None:
        """Record alarms raised outside the monitor's detectors (e.g. the rank outliers of
        :class:`~stability.adapters.distributed.ControlSync`, a stall watchdog's alarm).

        They go to the event log, the ``on_alarm`` handlers and, as one :class:`Alert`, to the
        alert sinks -- exactly like the monitor's own alarms -- but the policy does not act on
        them (the caller already did: e.g. every rank skipped the step).  Returns the recorded
        decision (``None`` when ``alarms`` is empty).
        """
        alarms = tuple(alarms)
        if not alarms:
            return None
        worst = max(alarms, key=lambda a: 2 if a.severity == "critical" else 1)
        text = "; ".join(a.message or f"{a.kind} on {a.signal}" for a in alarms[:4])
        alert = Alert(int(step), reason=text + (f" (+{len(alarms) - 4} more)"
                                                 if len(alarms) > 4 else ""),
                      severity=worst.severity, message=text)
        d = new_decision(int(step), alarms, (alert,), self._snapshot(), ())
        self._emit(d)
        return d

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

    def _make_alarms(self, step: int, rows: list[tuple[Binding, Any, Any]]
                     ) -> tuple[Alarm, ...]:
        """The step's alarms from each binding's scores and alarm flags (``rows``).

        A non-finite value alarms once: the other detectors' alarms on that signal are dropped.
        """
        names = self._slot_names
        bad: set[str] = set()
        for b, _, a in rows:
            if b.nonfinite and a.any():
                for i in np.flatnonzero(a).tolist():
                    bad.update(names[b.slots[j][i]] for j in range(b.n_inputs)
                               if b.slots[j][i] > SCRATCH)
        out: list[Alarm] = []
        for b, sc, a in rows:
            if not a.any():
                continue
            thr = float(b.det.threshold)
            items = []
            for i in np.flatnonzero(a).tolist():
                comps = [names[b.slots[j][i]] for j in range(b.n_inputs)
                         if b.slots[j][i] > SCRATCH]
                if not b.nonfinite and bad.intersection(comps):
                    continue
                score = float(sc[i])
                signal = ",".join(comps) if comps else b.keys[i]
                rec = False
                if b.nonfinite:
                    sev = "critical"
                    msg = f"{signal} is {NF_NAMES.get(score, 'non-finite')}"
                else:
                    sev, msg, rec = self._rated(b, step, signal, score, thr)
                items.append(Alarm(step, b.kind, signal, score, thr, sev, b.name, msg, rec))
            items.sort(key=lambda al: al.signal)
            out.extend(items)
        return tuple(out)

    def _rated(self, b: Binding, step: int, signal: str, score: float, thr: float
               ) -> tuple[str, str, bool]:
        """Severity, message and the recovering flag of a detector alarm: critical above
        ``critical_factor`` x the threshold, never while recovering
        (:mod:`stability.monitor.recovery`)."""
        rec = self._recovery.update(b.name, signal, step, score, thr)
        msg = f"{b.spec.detector} score {score:.4g} > {thr:.4g} on {signal}"
        if rec:
            sev = "warning" if b.severity == "critical" else b.severity
            return sev, msg + " (recovering)", True
        sev = "critical" if (b.severity == "critical" or score > b.critical_factor * thr
                             ) else b.severity
        return sev, msg, False

    # ====== batch replay (table decoding: monitor.replay)
    def replay(self, data: Any) -> Decisions:
        """Replay a recorded run: identical to a loop of :meth:`observe`, much faster.

        ``data``: a pyarrow ``Table`` / ``RecordBatch``, a pandas / polars ``DataFrame``, a dict
        of NumPy columns (``step`` plus one column per metric; nulls / masked / ``None`` = not
        logged; see :func:`stability.monitor.io.table_columns`), or an iterable of those
        (see :meth:`replay_batches`).  Non-numeric columns are ignored.

        Returns the :class:`Decisions`, one per row (a sequence; ``.events()`` lists those with
        alarms or interventions).
        """
        if is_table(data):
            return self._replay_table(data)
        return Decisions.concat(self.replay_stream(data))

    def replay_batches(self, batches: Iterable[Any]) -> Iterator[Decision]:
        """Replay batch after batch (bounded memory); detector state carries across batches."""
        for d in self.replay_stream(batches):
            yield from d

    def replay_stream(self, batches: Iterable[Any]) -> Iterator[Decisions]:
        """Replay batch after batch, one :class:`Decisions` per batch: the decisions of
        :meth:`replay` of the whole table, bit for bit, in bounded memory.

        Detector state carries across batches, and so do the replay's chunk blocks (the same
        pages, their constant parts written once), so a stream of batches of ~100K rows runs
        as fast as the whole table.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [{"name": "s", "detector": "ewma_z",
        ...                               "inputs": ["loss"]}]})
        >>> parts = [{"step": [0, 1], "loss": [1.0, 1.1]}, {"step": [2], "loss": [1.2]}]
        >>> [len(d) for d in mon.replay_stream(parts)]
        [2, 1]
        """
        blocks = ReplayBlocks()
        for batch in batches:
            out = self._replay_table(batch, blocks)
            del batch  # freed before the next batch is made
            yield out

    def bind_table(self, data: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
        """Bind a whole table the way :meth:`replay` does, without running any detector.

        Returns the steps and, per binding name, the ``(T, n_inputs, n_series)`` values and
        missing mask that replay feeds to that binding's detector -- the one binder shared by
        replay and offline tuning (:func:`replay.tuning.score_table`), so tuned thresholds
        reproduce online exactly.  Steps must be strictly increasing.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [{"name": "g", "detector": "ewma_z",
        ...                               "inputs": ["grad_norm/*"]}]})
        >>> steps, bound = mon.bind_table({"step": [0, 1], "grad_norm/a": [1.0, 2.0],
        ...                                "grad_norm/b": [3.0, 4.0]})
        >>> bound["g"][0].shape, bound["g"][0][1, 0].tolist()
        ((2, 1, 2), [2.0, 4.0])
        """
        steps, cols = decode_table(data)
        if np.any(np.diff(steps) <= 0):
            raise ValueError("bind_table: steps must be strictly increasing.")
        slotcol = self._bind_columns(cols)
        if self._dirty:
            self._relayout()
        t_len = len(steps)
        out: dict[str, tuple[Any, Any]] = {}
        for b in self._bindings:
            x = np.empty((t_len, b.n_inputs, len(b.keys)))
            m = np.empty(x.shape, dtype=np.bool_)
            _fill_bank(self._feeds(b, slotcol), x, m, 0, t_len)
            out[b.name] = (x, m)
        return np.asarray(steps, dtype=np.int64), out

    def bound_names(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` that feed a detector (binding them, as a replay would):
        the columns worth reading for a replay with this monitor's config.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [
        ...     {"name": "s", "detector": "ewma_z", "inputs": ["loss"]},
        ...     {"name": "g", "detector": "ewma_z", "inputs": ["grad_norm/*"]}]})
        >>> mon.bound_names(["train/loss", "epoch_time_s", "grad_norm/3"])
        ['train/loss', 'grad_norm/3']
        """
        return [n for n in names if self._lookup(n) > SCRATCH]

    def _table_slots(self, steps: Any, cols: list[tuple[str, Any, Any]]
                     ) -> tuple[Any, Any, Any]:
        """Steps, slot values ``(T, n_slots)`` and presence of decoded table columns (names
        bound in the order they first appear, as a live run would)."""
        slotcol = self._bind_columns([(n, (v, p)) for n, v, p in cols])
        if self._dirty:
            self._relayout()
        t_len, n_slots = len(steps), len(self._slot_names)
        vals = np.zeros((t_len, n_slots))
        pres = np.zeros((t_len, n_slots), dtype=np.bool_)
        for s, (v, p) in slotcol.items():
            if p is None:
                vals[:, s] = v
                pres[:, s] = True
            else:
                vals[p, s] = v[p]
                pres[:, s] = p
        return steps, vals, pres

    def _bind_columns(self, cols: list[tuple[str, Column]]) -> dict[int, Column]:
        """Bind the columns' names in the order they first appear (as a live run would) and
        return the column of every bound slot."""
        firsts = []
        for ci, (_, (_, p)) in enumerate(cols):
            if p is None:
                if len(cols[ci][1][0]):
                    firsts.append((0, ci))
            elif p.any():
                firsts.append((int(p.argmax()), ci))
        for _, ci in sorted(firsts):
            self._lookup(cols[ci][0])
        slotcol: dict[int, Column] = {}
        for name, col in cols:
            s = self._cache.get(name, SCRATCH)
            if s > SCRATCH:
                old = slotcol.get(s)
                slotcol[s] = col if old is None else merge_columns(old, col)
        return slotcol

    def _feeds(self, b: Binding, slotcol: dict[int, Column]
               ) -> list[tuple[int, int, Column | None]]:
        return [(j, i, slotcol.get(s)) for j, row in enumerate(b.slots)
                for i, s in enumerate(row)]

    def _replay_table(self, data: Any, blocks: ReplayBlocks | None = None) -> Decisions:
        """One table; ``blocks``: the chunk blocks of a stream of tables (``None``: this
        table's own)."""
        steps, cols = decode_table(data)
        t_len = len(steps)
        if t_len == 0:
            return Decisions.from_list([])
        if (steps[0] <= self.last_step or steps[0] < 0 or bool((steps[1:] <= steps[:-1]).any())
                or steps[-1] > MAX_STEP):
            return Decisions.from_list([
                self.observe(int(steps[t]), {n: float(v[t]) for n, (v, p) in cols
                                             if p is None or p[t]})
                for t in range(t_len)])
        slotcol = self._bind_columns(cols)
        if self._dirty:
            self._relayout()
        # no cyclic garbage is made here: a collection triggered by the bulk allocations (the
        # goodput history, decisions) would only scan the whole heap
        was = gc.isenabled()
        gc.disable()
        try:
            full = max(1024, table_replay.CHUNK_VALUES // max(1, len(slotcol)))
            chunk = min(t_len, full)
            if blocks is None:  # one table: blocks of its own size
                return Replay(self, steps, slotcol, chunk, ReplayBlocks(), chunk).run()
            return Replay(self, steps, slotcol, chunk, blocks, full).run()
        finally:
            if was:
                gc.enable()

    # ====== snapshots (field readers: monitor.state)
    def state_dict(self) -> dict[str, Any]:
        """Whole-monitor snapshot as JSON-compatible data (``json.dumps`` works, no NaN)."""
        sd = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "slots": self._slot_names[2:],
            "unbound": sorted(self.unbound),
            "families": {k: list(v.layers) for k, v in self._families.items()},
            "bindings": [{"name": b.name, "keys": list(b.keys), "slots": [list(c) for c in b.slots],
                          "detector": b.det.state_dict()} for b in self._bindings],
            "policy": self.policy.state_dict(),
            "policy_dirty": self._policy_dirty,
            "control": self.control.to_dict(),
            "policy_control": self._policy_control.to_dict(),
            "checkpoints": self.checkpoints.state_dict(),
            "goodput": self.goodput.state_dict(),
            "last_step": self.last_step,
            "stopped_at": self.stopped_at,
            "grad_history": list(self._grad_hist),
            "grad_last": self._grad_last,
            "lr_now": self._lr_now,
            "lr_prev": self._lr_prev,
            "counters": dict(self.counters),
            "recovery": self._recovery.state_dict(),
        }
        return encode_state(sd)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore a :meth:`state_dict` snapshot; the snapshot is checked before it is used.

        Precedence: **this monitor's config wins**.  Hyperparameters (thresholds, detector
        parameters, the policy) always come from :attr:`config`, never from the snapshot; the
        snapshot contributes state only -- the signal layout, each bank's statistics, the
        policy's incident state, the control, the checkpoint ledger, the goodput ledger and the
        counters -- and only where it is compatible with this config: same bindings, the same
        slot layout (re-derived from the snapshot's signal names, never trusted as indices),
        detector arrays of the right class, shapes and dtypes with ring positions and counts in
        range and finite statistics (see :meth:`detectors.BankDetector.validate_state_dict`).

        Parameters
        ----------
        state
            Output of :meth:`state_dict` (possibly through JSON).
        strict
            ``True`` (default): any incompatible part raises ``ValueError`` naming the field,
            and the monitor is left exactly as it was.  ``False``: each incompatible part
            (the layout, one bank, the policy, the control, the ledgers, the run history)
            *re-warms* -- it starts fresh -- with a ``UserWarning`` naming it; banks keep the
            statistics of the series the two layouts share.  A snapshot that is not a monitor
            snapshot at all (not a mapping, a newer version) raises in both modes.
        """
        backup = self.state_dict()
        try:
            self._load_state(state, strict)
        except Exception as exc:  # a hostile encoding may raise anything
            self._load_state(backup, True)  # a failed load changes nothing
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"Monitor.load_state_dict(): malformed snapshot "
                             f"({type(exc).__name__}: {exc}).") from exc

    def _load_state(self, state: Mapping[str, Any], strict: bool) -> None:
        """Install a snapshot (:meth:`load_state_dict` puts the backup back if this raises).

        The envelope, the layout and the goodput ledger are checked before anything changes;
        then the runtime is reset and each part installed in turn, a bad part re-warming on
        its own when not ``strict`` (:class:`~stability.monitor.state.PartLoader`).
        """
        f, snap = self._read_snapshot(state, strict)
        part = PartLoader(strict)
        layout = part("the signal layout", lambda: read_layout(f), ([], [], {}))
        # the goodput ledger is checked (into a scratch tracker) before anything changes
        gp = f.get("goodput", None)
        if gp is not None:
            gp = part("the goodput ledger", lambda: checked_goodput(gp), {})
        self._reset_runtime()
        self._install_layout(layout, part)
        self._install_banks(snap, layout[0], part, strict)
        self._install_policy(f, part)
        self._install_ledgers(f, gp, part)
        self._install_history(f, part)
        self._dirty = True

    def _read_snapshot(self, state: Mapping[str, Any],
                       strict: bool) -> tuple[Fields, dict[str, Fields]]:
        """Decode the snapshot and check its envelope: the version, and bindings that must be
        this monitor's (not strict: missing ones start fresh).  Returns the fields and each
        binding's snapshot by name."""
        try:
            sd = decode_state(state)
        except Exception as exc:
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
            # stacklevel 5: the warning names the caller of load_state_dict
            rewarm(msg + " Bindings missing from the snapshot start fresh.", stacklevel=5)
        if sd.get("config") is not None and sd.get("config") != self.config.to_dict():
            logger.info("Monitor.load_state_dict(): the snapshot was taken with another config; "
                        "this monitor's config (hyperparameters) wins.")
        return f, snap

    def _install_layout(self, layout: tuple[list[str], list[str], dict[str, list[str]]],
                        part: PartLoader) -> None:
        """Re-bind the snapshot's signal layout (names in slot order, unbound names,
        families) on fresh banks."""
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
            part(f"family {fam!r}", functools.partial(self.declare_family, fam, layers))

    def _install_banks(self, snap: Mapping[str, Fields], names: list[str], part: PartLoader,
                       strict: bool) -> None:
        """Each bank's statistics (:meth:`_load_bank`); a bank that fails stays fresh."""
        same_names = self._slot_names[2:] == names
        for b in self._bindings:  # re-binding left every bank fresh: that is the fallback
            bd = snap.get(b.name)
            if bd is not None:
                part(f"bank {b.name!r}",
                     functools.partial(self._load_bank, b, bd, same_names, strict))

    def _install_policy(self, f: Fields, part: PartLoader) -> None:
        """The policy's incident state and the control (the policy's own in ``log_only``)."""
        pol = f.get("policy", None)
        if pol is not None:
            part("the policy", lambda: self.policy.load_state_dict(pol),
                 self.policy.reset)
        self._policy_dirty = part("the policy flag", lambda: f.flag("policy_dirty", False), False)
        ctl = part("the control", lambda: (read_control(f, "control"),
                                           read_control(f, "policy_control")),
                   lambda: (Control(), Control()))
        self.control = ctl[0]
        self._ctrl_dirty = True  # per-step requests of the snapshot's step end with it
        self._snap = None
        self._policy_control = ctl[1] if self.log_only else self.control

    def _install_ledgers(self, f: Fields, gp: Any, part: PartLoader) -> None:
        """The checkpoint ledger, and the goodput ledger checked before anything changed."""
        led = f.get("checkpoints", None)
        if led is not None:
            part("the checkpoint ledger", lambda: self.checkpoints.load_state_dict(led),
                 lambda: self.checkpoints.load_state_dict({"records": [], "alarms": []}))
        if gp is not None:
            self.goodput.load_state_dict(gp)  # checked above ({} re-warms it)

    def _install_history(self, f: Fields, part: PartLoader) -> None:
        """The run history (last step, gradient norms, LRs, counters, the stop) and the
        recovery episodes."""
        keys = set(self.counters)
        hist = part("the run history", lambda: read_history(f, keys),
                    lambda: read_history(Fields("Monitor", {}), keys))
        self.last_step, grad_hist, self._grad_last, self._lr_now, self._lr_prev, counters = hist
        self._grad_hist.extend(grad_hist)
        self.counters.update(counters)
        self.stopped_at = part("the stop", lambda: f.opt_integer("stopped_at", lo=0), None)
        rec = f.get("recovery", None)
        if rec is not None:
            part("the recovery episodes", lambda: self._recovery.load_state_dict(rec))

    def _load_bank(self, b: Binding, g: Fields, same_names: bool, strict: bool) -> None:
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
            rewarm(msg + " Shared series keep their statistics; the others start fresh.")
            pos = {k: i for i, k in enumerate(keys)}
            checked = b.det.select_series(checked, [pos.get(k) for k in b.keys])
        b.det.apply_state(checked)

    # ====== bound inputs (monitor.bound.BoundInputs)
    _bound: BoundInputs | None = None

    def bind_inputs(self, keys: Sequence[str] = (),
                    families: Mapping[str, Sequence[str]] | Iterable[str] | None = None
                    ) -> BoundInputs:
        """Bind metric names and families once; returns their writable views.

        Parameters
        ----------
        keys
            Metric names (aliases allowed) logged every step, in the order of
            :attr:`BoundInputs.values`.  Each must feed a detector binding of the config.
        families
            Declared family names, or a mapping family name -> layer names (declared here,
            like :meth:`declare_family`).

        Returns
        -------
        BoundInputs
            Views to write each step's values into; :meth:`observe_bound` reads them.  Bind
            before the first ``observe()`` for a zero-copy binding (names bound in this
            order take consecutive slots).

        Raises
        ------
        ValueError, KeyError, TypeError
            A name that matches no binding (``observe()`` would ignore it), a layer or name
            a full bank refuses, two names for one signal, an undeclared family.
        """
        mon: Any = self
        if isinstance(keys, str):
            raise TypeError("bind_inputs: keys must be a sequence of metric names, not a str")
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("bind_inputs: keys and family names must be unique")
        resolve_slots(mon, keys, [])  # the keys first: they take the first slots of a fresh monitor
        if families is None:
            names: list[str] = []
        elif isinstance(families, Mapping):
            names = [str(f) for f in families]
            for f, layers in families.items():
                if str(f) not in mon._families or mon._families[str(f)].layers != [
                        str(x) for x in layers]:
                    mon.declare_family(str(f), layers)
        else:
            names = [str(f) for f in families]
        if len(set(names)) != len(names):
            raise ValueError("bind_inputs: keys and family names must be unique")
        key_slots, fam_slots = resolve_slots(mon, keys, names)
        inp = BoundInputs(mon, keys, names, key_slots, fam_slots)
        self._bound = inp
        return inp

    def observe_bound(self, step: int, metrics: Mapping[str, Any] | None = None, *,
                      inputs: BoundInputs | None = None) -> Decision:
        """:meth:`observe` of the values in the bound views (the latest :meth:`bind_inputs`,
        or ``inputs``), plus optional extra ``metrics`` -- the same decision, scores, state
        and goodput as ``observe(step, {bound keys present: values, **metrics}, {families:
        arrays})``."""
        mon: Any = self
        inp = self._bound if inputs is None else inputs
        if inp is None or inp._mon is not self:
            raise ValueError("observe_bound: no inputs bound to this monitor (call "
                             "bind_inputs first)")
        skipped: list[str] = []
        if mon._ctrl_dirty:
            mon.control.reset_step()
            mon._ctrl_dirty = False
            mon._snap = None
        if type(step) is int and mon.last_step < step <= MAX_STEP:
            s = step
        else:
            s = mon._check_step(step, skipped)
            if s is None:
                return mon._skipped_step(step, skipped)
        blk = inp._block
        if blk is not None and inp._target is mon._vals:
            mon._present_mv[blk] = inp._mask_mv  # the values are in place already
        else:
            inp._push()
        if metrics is not None:
            if isinstance(metrics, Mapping):
                if metrics:
                    mon._fill(metrics, skipped)
            else:
                mon._bad(f"metrics: expected a mapping; got {type(metrics).__name__}", skipped)
        if mon._dirty:
            mon._relayout()
        # from here on: observe()'s step, line for line
        if mon._fused:
            n_alarms = fused_step(*mon._fused_args)
        else:
            n_alarms = mon._plain_step()
        g, lr, loss, val, g_on, lr_on, loss_on, val_on = mon._tracked.tolist()
        if lr_on and loss_on and mon.policy.track_quiet(s, lr, loss, val if val_on else None):
            mon._lr_prev, mon._lr_now = mon._lr_now, lr
            tivs: tuple[Any, ...] = ()
        elif lr_on or loss_on or val_on:
            tivs = mon._track_values(s, lr if lr_on else None, loss if loss_on else None,
                                     val if val_on else None)
        else:
            tivs = ()
        mon.last_step = s
        return mon._finish_step(s, mon._live_rows() if n_alarms else None,
                                g if g_on else None, tivs, tuple(skipped) if skipped else ())


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


# ====== the batch replay engine: one table through the banks and the per-step tail
# (the engine of Monitor.replay, see stability.monitor.replay). Replay runs the bank kernels
# chunk by chunk over one decoded table, then the per-step tail. The banks' chunk blocks
# (inputs, missing masks, scores, alarms) live in a ReplayBlocks, which a stream of tables
# (Monitor.replay of an iterable of batches, Monitor.replay_batches) keeps from table to table:
# the blocks stay in the same pages, and what does not change from chunk to chunk (absent
# inputs, masks of columns without nulls, the non-finite guard's constant columns) is not
# written again.

class Decided:
    """The decisions of one replayed table, and the quiet steps not yet counted."""

    def __init__(self, mon: Monitor, steps: np.ndarray) -> None:
        self.mon = mon
        self.steps = steps
        self.explicit: dict[int, Decision] = {}
        self.starts: list[int] = []
        self.ctrls: list[Control] = []
        self.pending: list[list[Any]] = []  # [first row, end row, control snapshot]

    def quiet(self, a: int, b: int, snap: Control) -> None:
        if not self.ctrls or self.ctrls[-1] is not snap:
            self.starts.append(a)
            self.ctrls.append(snap)
        pend = self.pending
        if pend and pend[-1][1] == a and pend[-1][2] is snap:
            pend[-1][1] = b
        else:
            pend.append([a, b, snap])

    def flush(self) -> None:
        """Count the pending quiet steps (goodput ledger, step counter, goodput records)."""
        mon = self.mon
        counters = mon.counters
        every = mon.goodput_every if mon.event_log is not None else 0
        for a, b, snap in self.pending:
            c0 = counters["steps"]
            start = a
            if every:
                k = every - c0 % every
                while a + k <= b:
                    self._count(start, a + k, snap)
                    counters["steps"] = c0 + k
                    mon._log_goodput()
                    start = a + k
                    k += every
            self._count(start, b, snap)
            counters["steps"] = c0 + (b - a)
        self.pending = []

    def _count(self, a: int, b: int, snap: Control) -> None:
        if b <= a:
            return
        gp = self.mon.goodput
        if snap.rollback_to is not None:
            for s in self.steps[a:b].tolist():
                gp.update_from_control(s, snap)
            return
        gp.update_many(self.steps[a:b], skipped=snap.skip_step,
                       degraded=snap.lr_factor < 1.0 or snap.clip_norm is not None)

    def result(self) -> Decisions:
        self.flush()
        return Decisions(self.steps, self.explicit, self.starts, self.ctrls)


class ReplayBlocks:
    """The banks' chunk blocks for one layout: per binding ``(binding, guard, input block,
    fills it, scores, alarms)``.  Banks fed by the same slots in the same places share one
    input :class:`~stability.monitor.replay_fill.Block`, filled once per chunk by the first of
    them (kernels do not write their inputs); the non-finite guard has its own
    (:class:`~stability.monitor.replay_fill.GuardChunks`)."""

    def __init__(self) -> None:
        self.layout: Any = None  # the monitor's gather plan the blocks were made for
        self.rows = 0
        self.banks: list[tuple[Any, GuardChunks | None, Block, bool, np.ndarray,
                               np.ndarray]] = []
        self.tv = np.zeros((0, 0))
        self.tp = np.zeros((0, 0), dtype=np.bool_)

    def track_block(self, mon: Monitor, chunk: int,
                    tracked: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ``(slots, chunk)`` values / present block of the tracked slots (LR, loss,
        validation loss), kept across the tables of a stream (~9 MB on a wide run: made once,
        not faulted in at every batch); the rows of the slots not in ``tracked`` read absent."""
        k = max(mon._lr_slot, mon._loss_slot, mon._val_slot) + 1
        tv, tp = self.tv, self.tp
        if tv.shape[0] != k or tv.shape[1] < chunk:
            self.tv = tv = np.zeros((k, chunk))
            self.tp = tp = np.zeros((k, chunk), dtype=np.bool_)
        else:
            for s in (mon._lr_slot, mon._loss_slot, mon._val_slot):
                if s and s not in tracked:
                    tp[s] = False
        return tv, tp

    def get(self, mon: Monitor, chunk: int, rows: int) -> list[Any]:
        """The banks' blocks for chunks of ``chunk`` rows (made anew, of ``rows >= chunk``
        rows, when the layout changed or they are too short)."""
        if self.layout is not mon._gather or chunk > self.rows:
            blocks: dict[Any, Block] = {}
            banks = []
            for b in mon._bindings:
                n = len(b.keys)
                shape = (rows, b.n_inputs, n)
                guard: GuardChunks | None = None
                if GuardChunks.applies(b.det, b.n_inputs):
                    blk, fill = Block(shape), False
                    guard = GuardChunks(blk)
                else:
                    key = (shape, tuple(tuple(r) for r in b.slots))
                    fill = key not in blocks
                    if fill:
                        blocks[key] = Block(shape)
                    blk = blocks[key]
                banks.append((b, guard, blk, fill, np.empty((rows, n)),
                              np.empty((rows, n), dtype=np.bool_)))
            self.layout, self.rows, self.banks = mon._gather, rows, banks
        return self.banks


class Replay:
    """One table through the monitor: bank kernels chunk by chunk, then the per-step tail.

    ``chunk``: rows per chunk; ``blocks``: the banks' blocks (kept across the tables of a
    stream), made anew with ``rows`` rows when too short.
    """

    def __init__(self, mon: Monitor, steps: np.ndarray, slotcol: dict[int, Column],
                 chunk: int, blocks: ReplayBlocks, rows: int) -> None:
        self.mon = mon
        self.steps = steps
        self.slotcol = slotcol
        self.out = Decided(mon, steps)
        t_len = len(steps)
        self.chunk = chunk
        self.blocks = blocks
        self.rows = max(rows, chunk)
        g = mon._grad_slot
        self.grad = slotcol.get(g) if g else None
        tracked = [s for s in (mon._lr_slot, mon._loss_slot, mon._val_slot)
                   if s and s in slotcol]
        self.tracked = tracked
        need = None
        if tracked:
            need = np.zeros(t_len, dtype=np.bool_)
            for s in tracked:
                p = slotcol[s][1]
                if p is None:
                    need[:] = True
                    break
                need |= p
        self.need = need
        # the tracked slots as rows of a (slots, chunk) block: _track reads column r of it
        self.tv, self.tp = blocks.track_block(mon, self.chunk, tracked)

    def run(self) -> Decisions:
        mon = self.mon
        t_len = len(self.steps)
        banks = []
        for b, guard, blk, fill, sc, al in self.blocks.get(mon, self.chunk, self.rows):
            feeds: Feeds = mon._feeds(b, self.slotcol)
            if guard is not None:
                guard.table(b.det, feeds, t_len, self.chunk)
            banks.append((b, feeds, guard, blk, feed_sig(feeds) if fill else None, sc, al))
        for lo in range(0, t_len, self.chunk):
            hi = min(lo + self.chunk, t_len)
            c = hi - lo
            alarm = np.zeros(c, dtype=np.bool_)
            outs = []
            for b, feeds, guard, blk, sig, sc, al in banks:
                sc, al = sc[:c], al[:c]
                outs.append((b, sc, al))
                if not feeds:
                    continue
                if guard is not None:  # the non-finite guard: no input copy on finite chunks
                    guard.run(sc, al, lo, hi)
                else:
                    if sig is not None:
                        blk.fill(feeds, sig, lo, hi)
                    b.det.update_many_array(blk.x[:c], blk.m[:c], sc, al)
                if al.any():  # a flat test; the rows only when some series alarmed
                    alarm[np.flatnonzero(al.reshape(-1)) // al.shape[1]] = True
            self._tail(lo, hi, alarm, outs)
        for _, _, guard, *_ in banks:
            if guard is not None:  # no reference to this table's columns once replayed:
                guard.feeds = []   # the next batch is read into their pages
        return self.out.result()

    def _quiet_bulk(self, a: int, b: int) -> None:
        """Rows ``[a, b)``: no alarm, nothing to follow, no policy in force."""
        mon = self.mon
        mon.last_step = int(self.steps[b - 1])
        if self.grad is not None:
            v, p = self.grad
            g = v[a:b] if p is None else v[a:b][p[a:b]]
            g = g[np.isfinite(g)]
            if g.size:
                hist = mon._grad_hist
                hist.extend(g[-(hist.maxlen or g.size):].tolist())
                mon._grad_last = float(g[-1])
        self.out.quiet(a, b, mon._snapshot())

    def _track_bulk(self, a: int, b: int) -> int:
        """Follow the LR, loss and validation loss of rows ``[a, b)`` (no alarm on them) in
        bulk (:meth:`~stability.policy.policy.Policy.track_many`); returns the rows taken."""
        mon = self.mon
        cols: list[tuple[np.ndarray, np.ndarray] | None] = []
        for s in (mon._lr_slot, mon._loss_slot, mon._val_slot):
            col = self.slotcol.get(s) if s else None
            if col is None:
                cols.append(None)
            else:
                v, p = col
                cols.append((v[a:b], np.ones(b - a, dtype=np.bool_) if p is None else p[a:b]))
        k = int(mon.policy.track_many(self.steps[a:b], *cols))
        lr = cols[0]
        if k and lr is not None:  # the monitor's own record of the last two requested LRs
            seen = lr[0][:k][lr[1][:k]]
            if seen.size:
                mon._lr_prev = float(seen[-2]) if seen.size > 1 else mon._lr_now
                mon._lr_now = float(seen[-1])
        return k

    def _tail(self, lo: int, hi: int, alarm: np.ndarray,
              outs: list[tuple[Binding, np.ndarray, np.ndarray]]) -> None:
        mon = self.mon
        c = hi - lo
        need = self.need
        tv, tp = self.tv, self.tp
        if need is not None:
            need = need[lo:hi]
            for s in self.tracked:
                v, p = self.slotcol[s]
                tv[s, :c] = v[lo:hi]
                tp[s, :c] = True if p is None else p[lo:hi]
        ev = np.flatnonzero(alarm).tolist()
        n_ev = len(ev)
        steps = self.steps
        grad = self.grad
        hist = mon._grad_hist
        out = self.out
        finish = mon._finish_step
        track = mon._track
        k = 0
        r = 0
        while r < c:
            if not (mon._policy_dirty or mon._ctrl_dirty):
                while k < n_ev and ev[k] < r:
                    k += 1
                e = ev[k] if k < n_ev else c
                if e > r:
                    if need is not None:  # the LR / loss to follow, in bulk while nothing happens
                        e = r + self._track_bulk(lo + r, lo + e)
                    if e > r:
                        self._quiet_bulk(lo + r, lo + e)
                        r = e
                        continue
            t = lo + r
            s = int(steps[t])
            if mon._ctrl_dirty:
                mon.control.reset_step()
                mon._ctrl_dirty = False
                mon._snap = None
            gnow = None
            if grad is not None and (grad[1] is None or grad[1][t]):
                gnow = float(grad[0][t])
            mon.last_step = s
            tivs = track(s, tv[:, r], tp[:, r]) if need is not None and need[r] else ()
            if alarm[r] or tivs or mon._policy_dirty:
                out.flush()
                rows = [(b, sc[r], al[r]) for b, sc, al in outs] if alarm[r] else None
                out.explicit[t] = finish(s, rows, gnow, tivs, ())
            else:
                if gnow is not None and math.isfinite(gnow):
                    hist.append(gnow)
                    mon._grad_last = gnow
                out.quiet(t, t + 1, mon._snapshot())
            r += 1
