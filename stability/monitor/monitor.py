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
>>> mon.observe(21, {"loss": 2.0}).skipped
('step 21: not after the last observed step 21 (duplicate or out of order); not fed to detectors',)
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from detectors.dispatch import compiling
from stability.config.config import ConfigSource, MonitorConfig, load_config
from stability.monitor.binding import Aliases
from stability.monitor.bound import BoundInputs, BoundMixin
from stability.monitor.emit import EmitMixin, _decision
from stability.monitor.fused import fused_step, reference_step
from stability.monitor.layout import MAX_STEP, _Binding
from stability.monitor.replay import ReplayMixin
from stability.monitor.state import GRAD_HISTORY, STATE_VERSION, StateMixin
from stability.policy.context import PolicyContext
from stability.policy.policy import Policy
from stability.run.checkpoints import CheckpointLedger
from stability.run.goodput import GoodputTracker
from stability.types import Alarm, Control, Decision, Intervention, Rollback

__all__ = ["MAX_STEP", "STATE_VERSION", "BoundInputs", "Monitor"]

logger = logging.getLogger("stability.monitor")

#: Default seconds per step for all handler and sink calls (``[monitor] handler_budget_s``).
HANDLER_TIMEOUT = 1.0
_FROM_CONFIG: Any = object()


def _make_policy(cfg: Mapping[str, Any]) -> Policy:
    return Policy(dict(cfg))


def _new_control(src: Control) -> Control:
    c = object.__new__(Control)
    c.__dict__.update(src.__dict__)
    return c


class Monitor(BoundMixin, EmitMixin, ReplayMixin, StateMixin):
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
    The class is assembled from mixins: the slot layout (:mod:`stability.monitor.layout`),
    bound inputs (:meth:`bind_inputs` / :meth:`observe_bound`, :mod:`stability.monitor.bound`),
    batch replay (:mod:`stability.monitor.replay`) and snapshots
    (:mod:`stability.monitor.state`); :meth:`observe`, :meth:`observe_bound` and :meth:`replay`
    end every step with the same :meth:`_finish_step`.
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
        self._bindings = [
            _Binding(s, f"detectors[{i}]") for i, s in enumerate(self.config.detectors)
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
        self.counters = {"steps": 0, "skipped_steps": 0, "skipped_values": 0, "alarm_steps": 0,
                         "alarms": 0, "interventions": 0, "sink_errors": 0}

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
        return _decision(st, (), (), self._snapshot(), tuple(skipped))

    def _plain_step(self) -> int:
        """The step without the fused driver (:func:`reference_step`); the alarm count."""
        n_alarms = reference_step(self._vals, self._present, self._gather, self._calls,
                                  self._tslots, self._tracked)
        if self._fused_wait and not compiling():  # the background compiler is done:
            self._dirty = True  # the next step builds the fused plan
        return n_alarms

    def _finish_step(self, s: int, rows: list[tuple[_Binding, Any, Any]] | None,
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
            d = _decision(s, (), (), snap, skipped)
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
        d = _decision(s, alarms, ivs, self._snapshot(), skipped)
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
        ivs = tuple(self.policy.track(s, lr, loss, self._policy_control, val))
        if ivs or was or guard.active:
            self._snap = None
            self._policy_dirty = True
        if ivs:
            self._ctrl_dirty = True  # e.g. a stop: per-step requests end with this step
        return ivs

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


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
