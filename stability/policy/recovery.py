"""Recovery around the escalation ladder: what the policy follows every step, and its gates.

* :meth:`RecoveryMixin.track` follows the requested LR (the
  :class:`~stability.policy.lr_guard.LRGuard`) and the training / validation loss every step;
* the gates of a cause-aware response: is the run measurably *worse* than before the episode,
  is it *improving* since the policy started adapting, is every rollback *exhausted*;
* the *probation* after a rollback that skipped bad data (a data source that keeps failing ends
  in a stop with the healthy weights restored), and the overfitting early stop;
* the rollback anchors checkpoint retention must keep.

Mixed into :class:`stability.policy.policy.Policy`; see that module for the semantics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from stability.policy.attribution import DATA_CAUSES
from stability.policy.context import PolicyContext
from stability.policy.state import Aftermath, LRCut, PolicyState, Probation
from stability.types import Alarm, Alert, Control, Intervention, ReduceLR, Rollback, Stop

__all__ = ["RecoveryMixin"]


class RecoveryMixin(PolicyState):
    """Every-step tracking, probation and the recovery gates of the policy."""

    # ------------------------------------------------------------------ every step
    def track(self, step: int, lr: float | None = None, loss: float | None = None,
              control: Control | None = None, val: float | None = None) -> list[Intervention]:
        """Follow the requested LR and the training loss of every step, quiet ones included.

        Call before ``step()`` for the same step (the monitor does).  The LR goes to the
        :class:`~stability.policy.lr_guard.LRGuard`: when it leaves its healthy band the LR factor
        divides the fault out for as long as the scheduler keeps asking for it (an ``alert`` and
        a ``reduce_lr`` with ``duration = 0`` mark the start, an ``alert`` the release).  The
        loss feeds the "measurably worse" test that gates rollbacks of data-caused episodes and
        every stop.

        Returns
        -------
        list of Intervention
            Non-empty only when an LR fault starts or ends.
        """
        if type(step) is not int:
            step = int(step)
        out: list[Intervention] = []
        if val is not None:
            self.val.update(step, val, self.loss.fast)
        if loss is not None:
            # _track_loss, inlined (every step)
            self.loss.update(loss, step - self._ep.last_seen > self.config.cooldown
                             and not self.guard.active and self._probation is None
                             and self._after is None)
            if self._probation is not None:
                out = self._check_probation(step, control)
            elif self._aftermath_due(step):
                out = self._check_aftermath(step, control)
        if lr is None or not self.config.lr_guard.enabled or (
                out and any(isinstance(iv, Rollback) for iv in out)):
            return out  # (after a rollback the guard re-primes from the restored LR)
        g = self.guard
        was = g.active
        eff_prev = g.last_lr * g.factor  # the effective LR of the last step
        f = g.observe(step, lr)
        if g.active and not was:
            reason = (f"LR {g.last_lr:.3g} left its healthy band (last healthy LR {g.ref:.3g}, "
                      f"x{g.last_lr / g.ref:.3g})")
            msg = (f"step {step}: {reason} -> LR factor {f:.3g} for as long as the scheduler "
                   f"asks for it (cause: lr)")
            out += [Alert(step, reason, cause="lr", severity="critical", message=msg),
                    ReduceLR(step, reason, cause="lr", factor=f, duration=0, restore_steps=0)]
            self.n_responses += 1
            self.cause = "lr"
        elif was and not g.active:
            reason = f"LR {g.last_lr:.3g} back in its healthy band"
            ramp = self._release_ramp(step, eff_prev, g.last_lr)
            note = "" if ramp is None else (
                f"; LR factor {ramp.factor:.3g} ramped back to 1 over "
                f"{ramp.restore_steps} steps (the effective LR does not jump)")
            out += [Alert(step, reason, cause="lr", severity="warning",
                          message=f"step {step}: {reason}; LR guard released{note}")]
            if ramp is not None:
                out.append(ramp)
            if self._after is None and self._probation is None and g.onset >= 0:
                # the LR fault is over: does its damage outlive it?
                self._after = Aftermath(g.onset, step, "lr", step, 0, self.loss.fast)
        if control is not None and not self.log_only and (g.active or was):
            self._apply_persistent(step, control)
        return out

    def _release_ramp(self, step: int, eff_prev: float, lr: float) -> ReduceLR | None:
        """The LR guard releases at ``step``: the effective LR rises gradually, never at once.

        A fault that fades out (a multiplied LR decaying along a cosine schedule until it is
        back inside the band of the frozen reference) ends with the requested LR far above the
        effective LR the guard let through: releasing at once would multiply the effective LR
        by ``lr / eff_prev`` in one step.  The release starts from the effective LR of the last
        step instead (``eff_prev / lr``) and ramps back to 1 over ``lr.restore_steps`` steps
        (a ladder LR cut, so it is state, snapshot and replay like any other).  A fault that
        ends abruptly (the requested LR falls back to the healthy one) needs no ramp.
        """
        tol = self.config.lr_guard.tolerance
        if not (math.isfinite(eff_prev) and eff_prev > 0.0 and lr > eff_prev * tol):
            return None
        f0 = eff_prev / lr
        if self._lr is not None and self._ladder_lr_factor_at(step) <= f0:
            return None  # a deeper ladder cut is already in force
        restore = max(1, self.config.lr.restore_steps)
        self._lr = LRCut(step, f0, 0, restore)
        self._update_neutral()
        return ReduceLR(step, "the LR guard releases: ramp back to the requested LR", cause="lr",
                        factor=f0, duration=0, restore_steps=restore)

    def track_quiet(self, step: int, lr: float, loss: float, val: float | None = None) -> bool:
        """:meth:`track` ``(step, lr, loss, control, val)`` (``int`` step, ``float`` LR and
        losses) if it can request nothing: no probation, the LR guard enabled, primed and
        inactive, and ``lr`` inside its healthy band.  Returns ``False`` (and does nothing)
        otherwise.  The state afterwards is :meth:`track`'s, bit for bit: the same operations,
        inlined (the monitor's quiet step; ``control`` is not touched when nothing is asked).
        """
        g = self.guard
        if g.active or not g.primed or self._probation is not None or self._watching():
            return False
        c = g.config
        if not (0.0 < lr < math.inf and self.config.lr_guard.enabled):
            return False  # (NaN fails too); observe() ignores such an LR: general path
        # LRGuard.upper(), inlined
        ref = g.ref
        if g.n < c.min_steps or not math.isfinite(ref):
            up = math.inf
        elif not g.warm:
            up = ref * c.warmup_jump
        else:
            hi = ref
            if c.allow_restarts and math.isfinite(g.peak):
                hi = max(hi, g.peak)
            up = hi * c.tolerance
        if lr > up:
            return False  # an LR fault starts: general path
        if val is not None:
            self.val.update(step, val, self.loss.fast)
        # LossTracker.update(loss, quiet), inlined (the guard is and stays inactive)
        lt = self.loss
        if math.isnan(loss) or math.isinf(loss):
            lt.nonfinite_run += 1
        else:
            lt.nonfinite_run = 0
            if loss > 0.0:
                x = math.log(loss)
                fast = lt.fast
                lt.fast = x if math.isnan(fast) else fast + lt.fast_alpha * (x - fast)
                if step - self._ep.last_seen > self.config.cooldown:
                    base = lt.base
                    lt.base = x if math.isnan(base) else base + lt.base_alpha * (x - base)
        # LRGuard.observe(step, lr) -> _healthy(lr), inlined
        g.last_lr = lr
        g.n += 1
        if not (g.warm and not c.allow_restarts and ref <= lr):  # lr_guard.healthy_ref
            g.ref = lr
        peak = g.peak
        if not math.isfinite(peak) or lr > peak:
            g.peak = lr
            g.since_peak = 0
        else:
            g.since_peak += 1
            if g.since_peak >= c.settle:
                g.warm = True
        g.factor = 1.0
        return True

    def track_many(self, steps: Any, lr: Any = None, loss: Any = None, val: Any = None) -> int:
        """:meth:`track` over consecutive steps, in bulk, for as long as it requests nothing.

        ``lr`` / ``loss`` / ``val``: ``(values, present)`` float64 / bool arrays aligned with
        ``steps`` (``None``: not given on any of them).  Returns how many leading steps were
        taken: none while an LR fault or a probation is open, and never the step at which the
        LR leaves its healthy band (call :meth:`track` from there).  The state afterwards is
        that of a :meth:`track` loop over the steps taken (the replay's fast path).
        """
        n = len(steps)
        if self._probation is not None or n == 0 or self._watching():
            return 0
        if lr is not None and self.config.lr_guard.enabled and lr[1].any():
            g = self.guard
            if g.active or not g.primed:
                return 0
            pos = np.flatnonzero(lr[1])
            k = g.observe_healthy(lr[0][pos])
            if k < pos.size:
                n = int(pos[k])  # the LR at pos[k] starts a fault: track() takes it
        if loss is None and val is None:
            return n
        # the loss baseline learns from steps outside the cooldown after the last episode
        # (the guard stays inactive and no probation opens within the steps taken)
        rows = np.zeros(0, dtype=np.int64) if loss is None else np.flatnonzero(loss[1][:n])
        quiet = np.asarray(steps)[rows] - self._ep.last_seen > self.config.cooldown
        lv = np.zeros(0) if loss is None else loss[0][rows]
        vrows = np.zeros(0, dtype=np.int64) if val is None else np.flatnonzero(val[1][:n])
        # a validation point sees the loss level before its own step's loss
        levels = self.loss.update_many(lv, quiet, probe=np.searchsorted(rows, vrows))
        if vrows.size > 8:
            _val_many(self.val, np.asarray(steps)[vrows], val[0][vrows], levels)
            return n
        for i, level in zip(vrows.tolist(), levels.tolist(), strict=True):
            self.val.update(int(steps[i]), float(val[0][i]), level)
        return n

    def _track_loss(self, step: int, loss: float) -> None:
        quiet = (step - self._ep.last_seen > self.config.cooldown and not self.guard.active
                 and self._probation is None)
        self.loss.update(loss, quiet)

    # ------------------------------------------------------------------ rollback anchors
    @property
    def episode_onset(self) -> int | None:
        """First alarm step of the open episode (``None`` when none is open)."""
        return self._onset

    def rollback_anchors(self) -> list[int]:
        """Steps before which a rollback or restore may still be needed.

        The open episode's onset and the step after the best validation point: the latest
        healthy checkpoint before each must survive checkpoint retention.
        """
        out = [] if self._onset is None else [self._onset]
        if self._after is not None:
            out.append(self._after.onset)
        if self.guard.active and self.guard.onset >= 0:
            out.append(self.guard.onset)
        if self.val.best_step >= 0:
            out.append(self.val.best_step + 1)
        return out

    def rollback_failed(self, step: int) -> None:
        """The trainer could not carry out the rollback requested at ``step``: not counted."""
        self.n_rollbacks = max(0, self.n_rollbacks - 1)

    # ------------------------------------------------------------------ stops that restore
    def _check_probation(self, step: int, control: Control | None) -> list[Intervention]:
        """After a rollback that skipped bad data: does the data source keep failing?

        If the loss stays measurably worse than before the episode for ``adapt_steps`` steps
        within ``recur_steps`` of the rollback, the source is broken (a stuck loader, bad shards
        to the end): nothing left to try, so stop with the healthy checkpoint restored.
        """
        assert self._probation is not None
        pb = self._probation
        rc = self.config.recovery
        if step - pb.resume > rc.recur_steps:
            self._probation = None
            return []
        n_worse, ref = self._gap(pb.n_worse, pb.ref)
        self._probation = pb._replace(n_worse=n_worse, ref=ref)
        if n_worse < max(1, rc.adapt_steps):
            return []
        self._probation = None
        reason = (f"the loss stayed measurably worse without closing the gap for {n_worse} "
                  f"steps after the rollback at step {pb.resume} skipped the bad data: the "
                  f"data source keeps failing")
        return self._stop_restoring(step, pb.target, reason, pb.cause, control)

    def _gap(self, n_worse: int, ref: float) -> tuple[int, float]:
        """One step of a gap watch: ``(n_worse, ref)`` after this step's loss level.

        ``n_worse`` counts the steps the run has been measurably worse than before the episode
        *without closing the gap*.  ``ref`` is the worst recent level since the count began
        (or since the last fall): the recent level is an EW mean that lags, so while it still
        climbs towards a new level a comparison with its value when the count began would see
        no fall even when the loss itself is already coming down.  A fall below ``ref`` by more
        than ``recovery.improve_margin`` means the run is returning to its trajectory: the
        count restarts (in doubt, no stop: invariant 3).
        """
        fast = self.loss.fast
        if not self.worse():
            return 0, fast
        if math.isnan(ref) or n_worse == 0:
            return 1, fast
        ref = max(ref, fast)
        if fast < ref - self.config.recovery.improve_margin:
            return 0, fast  # closing the gap: returning to the trajectory
        return n_worse + 1, ref

    # ------------------------------------------------------------------ damage outliving its cause
    def _watching(self) -> bool:
        """An aftermath is being watched, or an episode's aftermath is still to be judged."""
        return self._after is not None or (
            self._onset is not None and self._judged_onset != self._onset
            and self.n_undo < self.config.recovery.max_undo)

    def _aftermath_due(self, step: int) -> bool:
        """Watch (or start watching) the aftermath of the open episode now?"""
        if self._after is not None:
            return True
        if (self._onset is None or self._judged_onset == self._onset or self.guard.active
                or self.n_undo >= self.config.recovery.max_undo):
            return False
        ep = self._ep
        if step - ep.last_seen <= self.config.cooldown:
            return False  # the episode is not over
        self._judged_onset = self._onset
        self._after = Aftermath(self._onset, ep.last_seen, ep.cause, step, 0, math.nan)
        return True

    def _check_aftermath(self, step: int, control: Control | None) -> list[Intervention]:
        """The episode is over: undo damage that outlives it (one rollback to before it).

        While the loss stays measurably worse than before the episode without closing the gap
        for ``adapt_steps`` steps (within ``recur_steps`` of the watch's start), the cause is
        gone but its damage is not: roll back to the latest healthy checkpoint before the
        onset (skipping the episode's batches when its cause was the data).  A run back to its
        level, or still closing the gap when the watch ends, is left alone.
        """
        af = self._after
        assert af is not None
        rc = self.config.recovery
        if self.guard.active or self.n_undo >= rc.max_undo or step - af.start > rc.recur_steps:
            self._after = None
            return []
        if not self.worse():
            self._after = None  # back to its pre-episode level: nothing to undo
            return []
        n_worse, ref = self._gap(af.n_worse, af.ref)
        self._after = af._replace(n_worse=n_worse, ref=ref)
        # the updates of a data episode came from batches that alarmed: with the data back to
        # normal and the loss still measurably worse, their damage is undone at once; any other
        # cause waits for adapt_steps steps without closing the gap
        wait = 1 if af.cause in DATA_CAUSES else max(1, rc.adapt_steps)
        if n_worse < wait:
            return []
        self._after = None
        return self._undo(step, af, control)

    def _undo(self, step: int, af: Aftermath, control: Control | None) -> list[Intervention]:
        """Roll back to the latest healthy checkpoint before ``af.onset`` (see
        :meth:`_check_aftermath`); nothing when there is none."""
        ledger = self.ledger
        target = None if ledger is None else ledger.latest_healthy_before(
            af.onset, self.config.checkpoint_margin)
        if target is None or self.n_rollbacks >= self.config.max_rollbacks:
            return []
        if af.cause not in DATA_CAUSES and any(abs(af.onset - o) <= 3
                                               for o, _ in self._rb_onsets):
            return []  # a rollback already replayed this step fault: it would again (inv. 6)
        data = af.cause in DATA_CAUSES
        reason = (f"the loss stayed measurably above its level before the episode of step "
                  f"{af.onset} (cause: {af.cause or 'unknown'}) for "
                  f"{self.config.recovery.adapt_steps} steps after it ended, without closing "
                  f"the gap: its damage outlives it")
        what = f"roll back to step {target.step}" + (
            f", skipping the batches of steps {af.onset}-{af.last}" if data else "")
        msg = f"step {step}: {reason} -> {what} (undo {self.n_undo + 1})"
        out: list[Intervention] = [
            Alert(step, reason, cause=af.cause, severity="critical", message=msg),
            Rollback(step, reason, cause=af.cause, to_step=target.step, skip_from=af.onset,
                     skip_to=af.last if data else af.onset - 1)]
        self.n_undo += 1
        self.n_rollbacks += 1
        if not data:
            self._rb_onsets = [*self._rb_onsets[-7:], (int(af.onset), af.cause)]
        self.n_responses += 1
        act = control is not None and not self.log_only
        resume = target.covers if act and self.config.rewind_on_rollback else step
        self._probation = (Probation(resume, target.step, 0, af.cause)
                           if data and af.cause else None)
        if act:
            assert control is not None
            control.rollback_to = target.step
            control.skip_batches = (af.onset, af.last) if data else None
            if self.config.rewind_on_rollback:
                self._rewind(step, target.covers, ledger)
        self._onset = None
        self._lr = self._clip = None  # the responses to the undone episode go with it
        self._update_neutral()
        self._reset_episode()
        self.guard.rewind()
        self.val.rewind(target.covers)
        return out

    def _overfit_stop(self, step: int, acts: Sequence[Alarm], cause: str, ctx: PolicyContext,
                      control: Control) -> list[Intervention] | None:
        """Overfitting: validation keeps getting worse while training does not -- an early stop
        with the checkpoint of the best validation point restored (``None``: not overfitting).
        """
        rc, val = self.config.recovery, self.val
        if not ("train_val_divergence" in {a.kind for a in acts}
                and val.worse_points >= rc.val_patience and cause == "divergence"
                and self.loss.fast < val.train_at_best + math.log1p(-rc.val_train_drop)):
            return None
        ledger = ctx.healthy_checkpoints
        rec = None if ledger is None else ledger.latest_healthy_before(
            val.best_step + 1, self.config.checkpoint_margin)
        reason = (f"validation loss {val.worse_points} points above its best "
                  f"({val.best:.4g} at step {val.best_step}) by more than "
                  f"{rc.val_margin:.0%} while the training loss fell "
                  f"{1 - math.exp(self.loss.fast - val.train_at_best):.0%} below its level "
                  f"then: overfitting")
        return self._stop_restoring(step, None if rec is None else rec.step, reason,
                                    "overfit", control)

    def _stop_restoring(self, step: int, target: int | None, reason: str, cause: str,
                        control: Control | None) -> list[Intervention]:
        """Stop with the checkpoint of ``target`` restored (``None``: nothing to restore)."""
        kept = "" if target is None else f" with the weights of step {target} restored"
        msg = (f"step {step}: {reason} -> stop{kept} (cause: {cause}; tried: "
               f"{self.n_rollbacks} rollback(s))")
        out: list[Intervention] = [
            Alert(step, reason, cause=cause, severity="critical", message=msg)]
        if target is not None:
            out.append(Rollback(step, reason, cause=cause, to_step=target, skip_from=step,
                                skip_to=step - 1))
        out.append(Stop(step, msg, cause=cause))
        self.n_responses += 1
        self.cause = cause
        if control is not None and not self.log_only:
            if target is not None:
                control.rollback_to = target
            control.stop = True
            control.stop_reason = msg
        return out

    # ------------------------------------------------------------------ gates
    def _improving(self) -> bool:
        fast, ref = self.loss.fast, self._ep.adapt_fast
        return not math.isnan(ref) and not math.isnan(fast) and fast < ref - 0.02

    def _start_adapting(self, step: int) -> None:
        """Start adapting (clip + LR cut) at ``step``: remember the loss level then."""
        self._ep.adapt_start = step
        self._ep.adapt_fast = self.loss.fast

    def _exhausted(self, step: int, ctx: PolicyContext) -> bool:
        """No rollback left to try: the limit is reached or no healthy checkpoint exists."""
        if self.n_rollbacks >= self.config.max_rollbacks:
            return True
        ledger = ctx.healthy_checkpoints
        onset = step if self._onset is None else self._onset
        return ledger is None or ledger.latest_healthy_before(
            onset, self.config.checkpoint_margin) is None


def _val_many(vt: Any, steps: np.ndarray, vals: np.ndarray, levels: np.ndarray) -> None:
    """``vt.update(steps[i], vals[i], levels[i])`` for each point in order (a
    :class:`~stability.policy.loss_tracker.ValTracker`), in bulk: the same comparisons and product,
    so the same state bit for bit."""
    v = np.asarray(vals, dtype=np.float64)
    fin = np.isfinite(v)
    x = np.where(fin, v, np.inf)  # a non-finite point never becomes the best
    best = np.minimum.accumulate(np.concatenate(([float(vt.best)], x)))  # best before point i
    new = np.flatnonzero(x < best[:-1])
    if new.size:
        j = int(new[-1])
        vt.best, vt.best_step, vt.train_at_best = float(v[j]), int(steps[j]), float(levels[j])
    worse = ~fin | (x > best[1:] * (1.0 + vt.margin))
    ok = np.flatnonzero(~worse)
    vt.worse_points = (vt.worse_points + v.size if ok.size == 0
                       else v.size - 1 - int(ok[-1]))
