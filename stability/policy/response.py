"""Building a response: the chosen actions of a step -> interventions, and LR-jump sizing.

:meth:`ResponseMixin._build` turns the action set the escalation ladder chose (``alert``,
``skip``, ``clip``, ``reduce_lr``, ``checkpoint``, ``rollback``, ``stop``) into
:class:`~stability.types.Intervention` records, sizes the clip and the LR cut, looks up the
rollback target in the checkpoint ledger and writes the ``Control`` (unless ``log_only``).
The LR-jump helpers size a cut to the jump behind an ``lr_jump`` alarm and re-arm its hold.

Mixed into :class:`stability.policy.policy.Policy`; see that module for the semantics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from stability.policy.attribution import DATA_CAUSES
from stability.policy.config import ACTIONS
from stability.policy.context import Ledger, PolicyContext, finite_or_none
from stability.policy.lr_schedule import adaptive_clip, compound_factor
from stability.policy.state import ClipHold, JumpHold, LRCut, PolicyState, Probation
from stability.types import (
    SEVERITIES,
    Alarm,
    Alert,
    Checkpoint,
    Control,
    Intervention,
    ReduceLR,
    Rollback,
    SetClip,
    SkipStep,
    Stop,
)

__all__ = ["SEV", "ResponseMixin"]

#: severity name -> rank
SEV = {s: i for i, s in enumerate(SEVERITIES)}


class ResponseMixin(PolicyState):
    """The response builder and the LR-jump helpers of the policy."""

    def _build(self, step: int, actions: set[str], by_kind: Mapping[str, list[Alarm]],
               level: int, ctx: PolicyContext, control: Control,
               jump: float | None = None) -> list[Intervention]:
        cfg = self.config
        act = not self.log_only
        reason = f"L{level}: " + "; ".join(
            f"{k}({_signals(v)})" for k, v in sorted(by_kind.items()))
        notes: list[str] = []
        out: list[Intervention] = []
        ledger = ctx.healthy_checkpoints
        self._rolled_back = False
        if "rollback" in actions and self._recurs(step):
            # rerun verdict: the same fault at the same step after a rollback to before it is
            # deterministic -- another rollback would replay it (invariant 6: not repeated)
            onset = step if self._onset is None else self._onset
            actions = actions - {"rollback", "checkpoint"}
            if self._storm:
                actions |= {"stop"}
            notes.append(f"the fault recurred at step {onset} after a rollback to before it: "
                         f"deterministic, a rollback does not help -- "
                         + ("stopping" if self._storm else "training through it"))
        if "rollback" in actions and self.n_rollbacks >= cfg.max_rollbacks:
            actions = (actions - {"rollback"}) | {"stop"}
            notes.append(f"rollback limit ({cfg.max_rollbacks}) reached")
        if "rollback" in actions:
            onset = step if self._onset is None else self._onset
            if ledger is None or ledger.latest_healthy_before(onset, cfg.checkpoint_margin) is None:
                actions = actions - {"rollback"}
                notes.append(f"no healthy checkpoint before onset {onset}: cannot roll back")
                if self.cause == "corruption":  # a broken state with nothing to restore
                    actions = actions | {"stop"}
        if "stop" in actions:
            worse = self.worse()
            if worse is False and not self._storm and self.cause != "data":
                actions = actions - {"stop"}
                notes.append("would stop, but the run is not measurably worse than before the "
                             "episode: continuing")
            else:
                tried = f"{self.n_rollbacks} rollback(s)"
                if self._ep.adapt_start is not None:
                    tried += f", adapting since step {self._ep.adapt_start}"
                notes.append(f"cause: {self.cause or 'unknown'}; tried: {tried}")
        if "skip" in actions:
            out.append(SkipStep(step, reason))
            if act:
                control.skip_step = True
        if "clip" in actions:
            current = self.clip_norm_at(step)
            if current is None:
                current = finite_or_none(ctx.clip_norm)
            med = finite_or_none(ctx.grad_norm_recent_median)
            norm = adaptive_clip(med, cfg.clip.factor, current, tighten=cfg.clip.tighten,
                                 min_norm=cfg.clip.min_norm, max_norm=cfg.clip.max_norm)
            if norm is None:
                notes.append("no gradient statistics to derive a clip from")
            else:
                self._clip = ClipHold(norm, step, cfg.clip.duration)
                out.append(SetClip(step, reason, max_norm=norm, duration=cfg.clip.duration))
        if "reduce_lr" in actions and jump is not None:
            j = cfg.lr_jump
            cur = self.lr_factor_at(step)
            held = self._jump_active(step)
            total = jump * (held.ratio if held is not None else 1.0)
            f = max(cfg.lr.min_factor, min(1.0, cur) * min(1.0 / jump, cfg.lr.factor))
            self._jump = JumpHold(total, step, f)
            self._lr = LRCut(step, f, j.hold, j.restore_steps)
            out.append(ReduceLR(step, reason, factor=f, duration=j.hold,
                                restore_steps=j.restore_steps))
            notes.append(f"LR jumped x{jump:.3g}: LR factor {f:.3g}, held until {j.hold} steps "
                         f"after the last jump alarm")
        elif "reduce_lr" in actions:
            f = compound_factor(self._ladder_lr_factor_at(step), cfg.lr.factor,
                                cfg.lr.min_factor)
            self._lr = LRCut(step, f, cfg.lr.duration, cfg.lr.restore_steps)
            out.append(ReduceLR(step, reason, factor=f, duration=cfg.lr.duration,
                                restore_steps=cfg.lr.restore_steps))
        if "checkpoint" in actions:
            out.append(Checkpoint(step, reason, healthy=False))
            if act:
                control.save_checkpoint = True
                control.checkpoint_reason = reason
        if "rollback" in actions:
            onset = step if self._onset is None else self._onset
            target = None if ledger is None else ledger.latest_healthy_before(
                onset, cfg.checkpoint_margin)
            skip_data = self.cause in DATA_CAUSES or not self.cause
            if target is None:
                notes.append(f"no healthy checkpoint before onset {onset}: cannot roll back")
            else:
                if self.cause == "data" and self._onset is None:
                    # no alarm marks where the bad data began: skip every batch since the
                    # restored checkpoint (the canary vouched for none after it)
                    onset = target.covers + 1
                out.append(Rollback(step, reason, to_step=target.step, skip_from=onset,
                                    skip_to=step if skip_data else onset - 1))
                self.n_rollbacks += 1
                if not skip_data:
                    self._note_rolled_back(onset)
                self._onset = None
                self._rolled_back = True  # log_only decides as if it had acted
                resume = target.covers if act and cfg.rewind_on_rollback else step
                self._probation = (Probation(resume, target.step, 0, self.cause)
                                   if skip_data and self.cause else None)
                if act:
                    control.rollback_to = target.step
                    control.skip_batches = (onset, step) if skip_data else None
                    if cfg.rewind_on_rollback:
                        self._rewind(step, target.covers, ledger)
                        self._rewound_to = target.covers
        if "stop" in actions:
            out += self._stop_restore(step, ledger, notes, control)
            out.append(Stop(step, reason + ("; " + "; ".join(notes) if notes else "")))
            if act:
                control.stop = True
                control.stop_reason = out[-1].reason
        if "alert" in actions or notes:
            sev = "critical" if (level >= 3 or actions & {"rollback", "stop"}
                                 or any(a.severity == "critical"
                                        for v in by_kind.values() for a in v)) else "warning"
            done = ", ".join(a for a in ACTIONS if a in actions and a != "alert") or "none"
            msg = f"step {step}: {reason} -> {done}" + ("; " + "; ".join(notes) if notes else "")
            out.insert(0, Alert(step, reason, severity=sev, message=msg))
        return out

    def _note_rolled_back(self, onset: int) -> None:
        """Remember the onset and cause of an episode undone by a rollback (a step fault
        replays there)."""
        self._rb_onsets = [*self._rb_onsets[-7:], (int(onset), self.cause)]

    def _replayed_cause(self, step: int) -> str | None:
        """The cause of the step-fault episode undone by a rollback that began where the open
        episode begins (``None``: none) -- the rollback replayed the fault, which is therefore
        deterministic (Megatron's rerun verdict), whatever the alarms look like this time."""
        onset = step if self._onset is None else self._onset
        for o, cause in self._rb_onsets:
            if abs(onset - o) <= 3:
                return cause
        return None

    def _recurs(self, step: int) -> bool:
        """Whether the open episode replays a step fault a rollback already undid."""
        return self.cause not in DATA_CAUSES and self._replayed_cause(step) is not None

    def _stop_restore(self, step: int, ledger: Ledger | None, notes: list[str],
                      control: Control) -> list[Intervention]:
        """A stop restores the latest healthy checkpoint before the episode (invariant 2):
        the :class:`Rollback` that goes with the :class:`Stop`, its note, and the control."""
        if self._rolled_back:
            return []  # this response's own rollback restores the healthy weights
        onset = step if self._onset is None else self._onset
        target = None if ledger is None else ledger.latest_healthy_before(
            onset, self.config.checkpoint_margin)
        if target is None:
            notes.append(f"no healthy checkpoint before step {onset}: the weights of step "
                         f"{step} are kept")
            return []
        notes.append(f"the weights of step {target.step} (the latest healthy checkpoint "
                     f"before the episode of step {onset}) restored")
        if not self.log_only:
            control.rollback_to = target.step
            control.skip_batches = None
        return [Rollback(step, "stop: restore the healthy weights", to_step=target.step,
                         skip_from=step, skip_to=step - 1)]

    # ------------------------------------------------------------------ LR jumps
    def _is_jump(self, a: Alarm) -> bool:
        j = self.config.lr_jump
        return a.detector in j.detectors and SEV.get(a.severity, 1) >= SEV[j.min_severity]

    def _jump_ratio(self, alarms: Sequence[Alarm], ctx: PolicyContext) -> float | None:
        """Ratio of the LR jump behind this step's LR-jump alarms (``None``: no such alarm).

        ``context.lr / context.lr_prev`` when both are known, else the lower bound
        ``exp(score * log_unit)`` from the largest alarm score.
        """
        scores = [a.score for a in alarms if self._is_jump(a)]
        if not scores:
            return None
        lr, prev = finite_or_none(ctx.lr), finite_or_none(ctx.lr_prev)
        if lr is not None and prev is not None and lr > 0.0 and prev > 0.0 and lr > prev:
            return lr / prev
        x = max(scores) * self.config.lr_jump.log_unit
        return math.exp(min(x, 700.0)) if not math.isnan(x) else math.inf

    def _jump_active(self, step: int) -> JumpHold | None:
        """The jump hold in force at ``step`` (still held or ramping back), else ``None``."""
        j = self.config.lr_jump
        if self._jump is None or not 0 <= step - self._jump.last < j.hold + j.restore_steps:
            return None
        return self._jump

    def _rearm(self, step: int, ratio: float) -> bool:
        """Extend the hold when ``ratio`` is the jump already held (e.g. a frozen detector)."""
        held = self._jump_active(step)
        j = self.config.lr_jump
        if held is None or ratio > j.rearm_tolerance * held.ratio:
            return False
        f = min(held.factor, self.lr_factor_at(step))
        self._jump = held._replace(last=step)
        self._lr = LRCut(step, f, j.hold, j.restore_steps)
        return True


def _signals(alarms: Iterable[Alarm], limit: int = 3) -> str:
    sig = sorted({a.signal for a in alarms})
    more = f", +{len(sig) - limit}" if len(sig) > limit else ""
    return ", ".join(sig[:limit]) + more
