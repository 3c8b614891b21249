"""Sync-free guard steps: ``TorchGuard(..., sync="deferred")`` (see ``docs/guides/sync-modes.md``).

``sync="step"`` copies each step's signal vector to the host (one ``.tolist()``) between
``backward()`` and ``optimizer.step()``: on a GPU the host waits for the backward pass and the
GPU then idles until the optimizer step is launched.  ``sync="deferred"`` never waits:

1. **Signals**: after ``backward()`` the vector is computed on the device
   (:meth:`~stability.adapters.torch_ops.signals.SignalCollector.measure`) and copied without
   blocking
   into a reused host buffer (pinned on CUDA, a plain copy on the CPU), a CUDA event recorded.
2. **One step late**: the guard observes the *previous* step's signals (copied a step ago:
   its event is done or nearly) under that step's number -- the monitor sees the signal stream
   of ``sync="step"``, recorded runs replay to the same decisions.  Step ``t``'s decision acts
   from step ``t + 1``: its LR factor and clip norm govern step ``t + 1``'s update; its
   checkpoints are taken at once (the weights are still those after step ``t``: health flag and
   monitor state as with ``sync="step"``); a rollback or stop *voids* step ``t + 1`` (no
   update, signals dropped, no scheduler step) and :meth:`DeferredSteps.finish` carries it out
   with step ``t``'s counter and data position, as ``sync="step"`` does at step ``t``.  The LR
   a step asks for is a host number: a probe copy of the policy's
   :class:`~stability.policy.lr_guard.LRGuard` judges it before that step's update (an LR blow-up is
   divided out from its first step); the smaller factor of the two applies.
3. **A late ``skip_step``** (its step's update is applied) is not carried over to the next,
   healthy batch: the update was bounded on the device (below), the step is unhealthy (never a
   rollback target) and an escalating policy still rolls back.  Counted in
   :attr:`DeferredSteps.late_skips`; the goodput ledger counts it as skipped.  It arms the
   *skip gate* (:mod:`.deferred_gate`): a run of bad batches is skipped from its second on.
4. **Device-side safety** before every optimizer step, no sync: the gradients are clipped with
   a coefficient computed on the device (as ``clip_grad_norm_(foreach=True)``) at the tightest
   of the guard's ``clip_norm``, the last decision's and the *spike clip* --
   :data:`SPIKE_FACTOR` times the median gradient norm of the last healthy observed steps,
   standing in for the late skip of a spike (``guard.deferred.spike_factor = None``: off).
   Non-finite gradients never reach the weights: fused Adam / AdamW / SGD
   (``_step_supports_amp_scaling``) get ``optimizer.found_inf`` (as ``GradScaler`` sets it)
   and skip the update in the kernel, weights and state untouched; other optimizers get
   all-zero gradients (``torch.where``: ``NaN * 0`` is NaN) -- momentum and weight decay still
   move their weights.  A ``GradScaler`` skips overflow steps itself (on the device with a
   fused optimizer, else with its own ``.item()`` in ``scaler.step``).  The update ratio after a
   skipped step is not reported, as with ``sync="step"``.
5. **Flush**: :meth:`~stability.adapters.torch.TorchGuard.flush` observes the last step and
   carries out its decision (``detach()`` and a hand-saved checkpoint flush first).
   ``state_dict()`` observes nothing: it carries the pending step's signals and the control in
   force.
6. **Distributed**: decisions are reduced across ranks (``ControlSync``) when observed, one step
   late, at the same step everywhere -- the one host sync left on a distributed step path.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stability._state_check import Fields
from stability.adapters.guard.deferred_gate import GateState, SkipGate, parse_gate
from stability.adapters.interventions import TrainingStopped, drop_gradients, tightest_clip
from stability.adapters.torch_ops.signals import SignalLayout, Signals
from stability.policy.lr_guard import LRGuard
from stability.types import Control, Decision

__all__ = ["SYNC_MODES", "DeferredSteps", "device_skips", "parse_deferred"]

log = logging.getLogger("stability.adapters")

#: The guard's two step paths (``sync="auto"`` resolves to one: :mod:`.sync_mode`).
SYNC_MODES = ("step", "deferred")
#: Spike clip: gradients are clipped on the device at this many times the median global
#: gradient norm of the last :data:`SPIKE_WINDOW` healthy observed steps (once
#: :data:`SPIKE_MIN` are known), standing in for the skip that comes too late.
SPIKE_FACTOR = 10.0
SPIKE_WINDOW = 32
SPIKE_MIN = 16


@dataclass
class _Pending:
    """One step's signals on their way to the host."""

    step: int
    layout: SignalLayout | None
    view: np.ndarray | None  # numpy view of the host buffer
    event: Any = None  # torch.cuda.Event of the copy (None: nothing to wait for)
    ready: Signals | None = None

    def signals(self) -> Signals:
        if self.ready is None:
            assert self.layout is not None and self.view is not None
            if self.event is not None:
                self.event.synchronize()  # recorded a step ago: done, or nearly
            self.ready = self.layout.unpack(self.view.tolist())  # numpy: host memory
        return self.ready


class _HostBuffers:
    """Two reused host buffers (pinned for CUDA) and their numpy views: step ``t`` is copied
    into one while step ``t - 1`` is read from the other."""

    def __init__(self) -> None:
        self._bufs: list[tuple[torch.Tensor, np.ndarray] | None] = [None, None]
        self._i = 0

    def take(self, n: int, cuda: bool) -> tuple[torch.Tensor, np.ndarray]:
        self._i ^= 1
        have = self._bufs[self._i]
        if have is None or have[0].numel() < n:
            buf = torch.empty(max(2 * n, 256), dtype=torch.float32,
                              pin_memory=cuda and torch.cuda.is_available())
            have = self._bufs[self._i] = (buf, buf.numpy())
        return have[0][:n], have[1][:n]


class DeferredSteps:
    """The per-step machinery of a ``sync="deferred"`` guard (see the module docstring).

    Attributes
    ----------
    pending : step whose signals are still on their way (``None`` when none)
    late_skips : int
        ``skip_step`` requests that arrived after their step's update (not carried out).
    gate : SkipGate
        The skip gate (``gate.factor = None``: off); ``gate.gated`` counts its skips.
    """

    def __init__(self, guard: Any) -> None:
        self.g = guard
        self.pending: _Pending | None = None
        self.late_skips = 0
        self._void: tuple[int, Control] | None = None  # step whose stop/rollback voids this one
        self._bad_step: int | None = None  # last observed step the device (or scaler) skipped
        self._found_inf = False
        self._stop_due: TrainingStopped | None = None
        self._buffers = _HostBuffers()
        self._zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._norms: deque[float] = deque(maxlen=SPIKE_WINDOW)  # healthy grad norms
        self.spike_factor: float | None = SPIKE_FACTOR
        self.gate = SkipGate()

    # ------------------------------------------------------------------ one step
    def step(self, loss: Any, metrics: Mapping[str, Any] | None) -> Decision:
        """``TorchGuard.step`` in deferred mode (a voided step does not step the scheduler)."""
        g = self.g
        t = g.step_count
        decision = self.check(loss, metrics, None)
        try:
            if g.scaler is not None:
                if g.should_step:
                    g.scaler.step(g.optimizer)
                g.scaler.update()
            elif g.should_step:
                g.optimizer.step()
            g.multiplier.restore()
            if g.scheduler is not None and g.should_step:
                g.scheduler.step()
                g.misuse.scheduler_stepped()
        finally:
            g.optimizer.zero_grad(set_to_none=True)
            self._clear_found_inf()
        self.finish()
        if g.watchdog is not None:
            g.watchdog.beat(t)
        return decision

    def check(self, loss: Any, metrics: Mapping[str, Any] | None,
              signals: Signals | None) -> Decision:
        """Start step ``t``'s signals, observe step ``t - 1``'s, protect step ``t``'s update."""
        g = self.g
        if signals is not None:
            raise ValueError("TorchGuard.check(signals=...) is not supported with "
                             "sync='deferred' (the guard measures the signals itself).")
        if self._stop_due is not None:  # a stop observed by a flush that could not raise
            stopped, self._stop_due = self._stop_due, None
            raise stopped
        t = g.step_count
        g._pos_of_step[t] = g.data_position
        while len(g._pos_of_step) > 100_000:
            g._pos_of_step.popitem(last=False)
        extra = g._extra(metrics)
        vec, layout = g.collector.measure(loss, extra)
        started = self._start(t, vec, layout)
        decision = self._observe_pending()
        if self._void is not None:  # a stop / rollback of step t - 1: step t is thrown away
            g.should_step = False
            drop_gradients(g.collector.params)
        else:
            self.pending = started
            g.should_step = True
            control = g.control
            g.multiplier.factor = min(float(control.lr_factor),
                                      self._lr_guard_factor(t, extra.get("lr")))
            self._protect(vec, layout, tightest_clip(tightest_clip(g.clip_norm, control.clip_norm),
                                                     self._spike_clip()))
            g.collector.before_step(t)
            g.multiplier.apply()
        return decision if decision is not None else Decision(-1)

    def finish(self) -> None:
        """After the optimizer step: a voided step ends with the stop / rollback; advances."""
        g = self.g
        self.gate.release()  # a gated step's weights and optimizer state put back
        g.rolled_back = False
        g.collector.after_step(stepped=g.should_step)
        g._consumed = True
        self._clear_found_inf()
        void, self._void = self._void, None
        if void is not None:
            s, control = void
            g.step_count, g.data_position = s, g._pos_of_step.get(s, g.data_position)
            if g._end_run(s, control, g.raise_on_stop):
                return
            g.step_count, g.data_position = s + 1, g.data_position + 1  # rollback refused
        else:
            t = g.step_count
            g.step_count = t + 1
            g.data_position = g._pos_of_step.get(t, g.data_position) + 1
        g.collector.begin_step(g.step_count)
        g.multiplier.show()
        if g.checkpoints.sigterm_received():
            self.flush(g.raise_on_stop)  # checkpoints this step, then lets SIGTERM go on

    def flush(self, raise_stop: bool) -> Decision | None:
        """Observe the pending step once its update is done; carry out its decision."""
        g = self.g
        if self.pending is None or self.pending.step >= g.step_count:
            return None  # nothing pending, or its update is not applied yet (mid-step)
        saved = g.step_count, g.data_position
        decision = self._observe_pending()
        void, self._void = self._void, None
        if void is not None:
            s, control = void
            g.step_count, g.data_position = s, g._pos_of_step.get(s, g.data_position)
            if g._end_run(s, control, raise_stop):  # (raises a stop when raise_stop)
                if control.stop and g.raise_on_stop:
                    self._stop_due = g.stopped  # raised by the next check()
                return decision
            g.step_count, g.data_position = saved
        return decision

    # ------------------------------------------------------------------ internals
    def _start(self, t: int, vec: torch.Tensor, layout: SignalLayout) -> _Pending:
        """Copy step ``t``'s vector to a host buffer without waiting for it."""
        cuda = vec.device.type == "cuda"
        host, view = self._buffers.take(vec.numel(), cuda)
        event = None
        if cuda:
            host.copy_(vec, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(vec.device))
        else:
            host.copy_(vec)
        return _Pending(t, layout, view, event)

    def _observe_pending(self) -> Decision | None:
        """Observe the pending step ``s`` with counters at ``s``: decide, take its checkpoints,
        and remember a stop / rollback (it voids the step in progress)."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        g = self.g
        s = p.step
        sig = g._amp_post(p.signals())
        if self._bad_step is not None and self._bad_step == s - 1:
            sig.families.pop("update_ratio", None)  # the skipped step had no update
        gated = self.gate.observed(s, sig.scalars)
        if gated or g.amp_overflow or not math.isfinite(sig.scalars.get("grad_norm", 0.0)):
            self._bad_step = s
        saved = g.step_count, g.data_position
        g.step_count, g.data_position = s, g._pos_of_step.get(s, g.data_position)
        try:
            decision = g._decide(s, sig)
            control = g.control
            gn = sig.scalars.get("grad_norm", math.nan)
            if g.healthy and math.isfinite(gn):
                self._norms.append(gn)
            self.gate.note(sig.scalars, g.healthy)
            if control.skip_step and not gated:
                self.late_skips += 1
                log.debug("skip_step for step %d arrived after its update (sync='deferred')", s)
            if control.save_checkpoint:  # unhealthy: kept for forensics, never a target
                g.checkpoints.auto(healthy=False, reason=control.checkpoint_reason or "emergency")
            if control.stop or control.rollback_to is not None:
                self._void = (s, control)
            else:
                g.checkpoints.due(s)  # the weights are those after step s's update
        finally:
            g.step_count, g.data_position = saved
        return decision

    def _spike_clip(self) -> float | None:
        """:data:`SPIKE_FACTOR` times the median healthy gradient norm (``None``: not yet)."""
        if self.spike_factor is None or len(self._norms) < SPIKE_MIN:
            return None
        return self.spike_factor * statistics.median(self._norms)

    def _lr_guard_factor(self, t: int, lr: Any) -> float:
        """The LR guard's factor for the LR step ``t`` asks for, judged now: the requested LR
        is a host number, so it needs no delay (the monitor still observes it a step later).
        A probe copy of the policy's :class:`~stability.policy.lr_guard.LRGuard` judges it."""
        policy = getattr(self.g.monitor, "policy", None)
        guard = getattr(policy, "guard", None)
        if not isinstance(guard, LRGuard) or not guard.config.enabled or \
                getattr(policy, "log_only", True) or not isinstance(lr, float):
            return 1.0
        probe = copy.copy(guard)  # scalars only: the real guard is untouched
        f = probe.observe(t, lr)
        return f if probe.active else 1.0

    def _protect(self, vec: torch.Tensor, layout: SignalLayout, norm: float | None) -> None:
        """Clip on the device; keep non-finite gradients, and a gated step's update, from the
        weights (no host sync)."""
        g = self.g
        grads = g.collector.local_grads()  # (local shards of sharded parameters)
        if not grads:
            return
        fused = g.scaler is None and device_skips(g.optimizer)
        fire = self.gate.arm(g.step_count, g.control.skip_step, vec, layout.names, layout.host,
                             g.sync)
        with torch.no_grad():
            total = vec[0]
            ok = torch.isfinite(total)
            if norm is not None:
                # computed as sync="step" does on the host (float64): the same bits
                wide = total.double() if total.device.type != "mps" else total
                coef = torch.where(wide > norm, norm / (wide + 1e-6), 1.0).to(total.dtype)
                for dev_grads in _by_device(grads).values():
                    torch._foreach_mul_(dev_grads, coef.to(dev_grads[0].device))
            if fire is not None and (fused or not self.gate.hold(g.optimizer)):
                ok = ok & ~fire  # the gated step joins the non-finite ones
            elif g.scaler is not None:
                return  # the scaler skips a step with non-finite gradients itself
            if fused:
                g.optimizer.found_inf = (~ok).float()  # the fused kernel skips the update
                self._found_inf = True
                return
            for gr in grads:
                key = (gr.device, gr.dtype)
                zero = self._zeros.get(key)
                if zero is None:
                    zero = self._zeros[key] = torch.zeros((), dtype=gr.dtype, device=gr.device)
                torch.where(ok.to(gr.device), gr, zero, out=gr)

    def _clear_found_inf(self) -> None:
        if self._found_inf:
            self._found_inf = False
            if hasattr(self.g.optimizer, "found_inf"):
                del self.g.optimizer.found_inf

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The pending step's signals (waits for their copy) and the control in force."""
        p = self.pending
        pending = None
        if p is not None:
            sig = p.signals()
            pending = {"step": p.step,
                       "scalars": {k: _json_float(v) for k, v in sig.scalars.items()},
                       "families": {k: [_json_float(x) for x in v.tolist()]
                                    for k, v in sig.families.items()}}
        return {"pending": pending, "control": self.g.control.to_dict(),
                "bad_step": self._bad_step, "late_skips": self.late_skips,
                "grad_norms": list(self._norms), "gate": self.gate.state_dict()}

    def load_state_dict(self, sd: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict` output (``None``: nothing pending, default control)."""
        (self.pending, self.g.control, self._bad_step, self.late_skips,
         norms, gate) = parse_deferred(sd)
        self._norms = deque(norms, maxlen=SPIKE_WINDOW)
        self.gate.load_state_dict(gate)
        self._void = None


def parse_deferred(sd: Mapping[str, Any] | None) -> tuple[
        _Pending | None, Control, int | None, int, list[float], GateState]:
    """Check :meth:`DeferredSteps.state_dict` output; ``ValueError`` names a bad field."""
    if sd is None:
        return None, Control(), None, 0, [], ([], 0, 0, None)
    f = Fields("TorchGuard", sd, "deferred.")
    pending = None
    if f.get("pending", None) is not None:
        pf = f.sub("pending")
        scal, fams = pf.sub("scalars"), pf.sub("families")
        pending = _Pending(pf.integer("step", lo=0), None, None, ready=Signals(
            scalars={str(k): scal.number(k, nan=True, inf=True) for k in scal.sd},
            families={str(k): np.asarray([fams.number(f"{k}[{i}]", x, nan=True, inf=True)
                                          for i, x in enumerate(fams.seq(k))],
                                         dtype=np.float64) for k in fams.sd}))
    cf = f.sub("control", {})
    control = Control.from_dict(cf.sd) if cf.sd else Control()
    cf.number("lr_factor", control.lr_factor, lo=0.0, low_open=True)
    cf.opt_number("clip_norm", control.clip_norm, lo=0.0, low_open=True)
    bad = f.opt_integer("bad_step", lo=0)
    norms = [f.number(f"grad_norms[{i}]", x, lo=0.0)
             for i, x in enumerate(f.seq("grad_norms", None, f.get("grad_norms", [])))]
    return (pending, control, bad, f.integer("late_skips", f.get("late_skips", 0), lo=0),
            norms[-SPIKE_WINDOW:], parse_gate(f.sub("gate", {})))


def device_skips(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` skips an update on the device: fused Adam / AdamW / SGD /
    Adagrad (``_step_supports_amp_scaling``) read ``optimizer.found_inf`` in their kernel."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)
