"""Policy: turn alarms into one coherent response per incident, chosen from its *cause*.

Every step (quiet ones too) :meth:`Policy.track` follows the requested LR (the
:class:`~stability.policy.lr_guard.LRGuard` divides an LR fault out for as long as the scheduler
asks for
it) and the training loss ("measurably worse" than before the episode).  On alarm steps
:meth:`Policy.step` attributes the episode (:mod:`stability.policy.attribution`: ``lr``,
``outlier``,
``shift``, ``corruption``, ``overflow``, ``divergence``) and gates the ladder below with it:
an outlier is skipped or clipped; a persistent shift gets at most
``recovery.max_consecutive_skips`` skips, then *adapts* (clip + LR cut) and rolls back only when
still measurably worse and not improving after ``recovery.adapt_steps``, followed by a probation
that stops a data source that keeps failing with the healthy weights restored; corruption rolls
back at once without skipping batches; a rollback ends the episode (escalation resets); a stop
happens only when no rollback is left and the run is measurably worse.

The policy keeps one *escalation level* shared by the kinds whose rule has ``escalate = true``
(loss spikes, gradient explosions, activation shifts, non-finite values, LR/loss anomalies).  A
response is the set of actions of the current level in the kind's ladder; the default ladder is

1. ``alert`` + ``clip``: a tighter gradient clip, ``clip.factor`` x the median of the recent
   gradient norms (``context.grad_norm_recent_median``), never above the clip in force;
2. ``alert`` + ``reduce_lr``: multiply the LR by ``lr.factor`` for ``lr.duration`` steps, then
   restore it gradually over ``lr.restore_steps`` steps;
3. ``alert`` + ``checkpoint`` + ``rollback``: an emergency checkpoint (tagged unhealthy), then a
   rollback to the latest *healthy* checkpoint before the incident's onset, skipping the batches
   ``[onset, now]``;
4. ``alert`` + ``stop``.

LR jumps (``[policy.lr_jump]``): a critical alarm of an ``lr_jump`` detector means the scheduler's
LR itself jumped by a ratio ``r``.  Whatever the level or cooldown, the response is a cut sized to
the jump -- the LR factor in force times ``min(1/r, lr.factor)``, floored at ``lr.min_factor`` --
held until ``lr_jump.hold`` steps after the latest jump alarm (further alarms of the same jump
re-arm the hold without compounding), then ramped back; if damage alarms (loss spike, gradient
explosion, ...) came first, also a checkpoint + rollback.  ``r`` is ``context.lr /
context.lr_prev`` when the monitor passes them, else ``exp(score * lr_jump.log_unit)``.

Independently of the level, the optimizer step is skipped on every alarm step whose kind's
``skip`` rule matches (``nonfinite``: always; most kinds: on critical alarms).

Timing:

* **cooldown** -- alarms within ``cooldown`` steps of a response are merged into it (no new
  response; only ``SkipStep`` still applies).  All alarms of one step are merged too, so a storm
  gives one response.  A kind with ``patience`` (``nonfinite``: 3 alarm steps within the
  escalation window) jumps to ``persist_level`` even inside a cooldown;
* **escalation** -- a response within ``escalation_window`` steps of the previous one goes one
  level up; a later one repeats the current level;
* **hysteresis** -- the level drops by one per ``quiet_steps`` steps without alarms.

On a step without (actionable) alarms :meth:`Policy.step` changes nothing but the persistent
``Control`` fields, which are a pure function of (state, step) -- see :meth:`Policy.control_at`.
The batch replay may therefore call :meth:`Policy.step` only on alarm steps.

The class is assembled from: :mod:`stability.policy.state` (state records, snapshot format and
the pure queries), :mod:`stability.policy.recovery` (every-step tracking, probation, recovery
gates), :mod:`stability.policy.response` (actions -> interventions, LR-jump sizing) and
:mod:`stability.policy.context` (the :class:`PolicyContext` the monitor passes, the
:class:`Ledger` protocol); the escalation ladder itself is :meth:`Policy.step` here.

Examples
--------
>>> from stability.types import Alarm, Control
>>> pol = Policy({"cooldown": 5, "escalation_window": 50})
>>> ctl = Control()
>>> spike = lambda s: [Alarm(s, "loss_spike", "loss", 9.0, 6.0, "warning", "ewma_z")]
>>> [i.type for i in pol.step(100, spike(100), ctl, {"grad_norm_recent_median": 0.5})]
['alert', 'set_clip']
>>> ctl.clip_norm
1.0
>>> pol.step(102, spike(102), ctl)                  # inside the cooldown: merged
[]
>>> [i.type for i in pol.step(110, spike(110), ctl)]  # recurs within the window: level 2
['alert', 'reduce_lr']
>>> ctl.lr_factor, pol.control_at(300).lr_factor
(0.5, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from stability.policy.attribution import attribute
from stability.policy.config import PolicyConfig
from stability.policy.context import CheckpointRef, Ledger, PolicyContext
from stability.policy.recovery import RecoveryMixin
from stability.policy.response import SEV, ResponseMixin
from stability.policy.state import (
    INF_STEP,
    STATE_VERSION,
    ClipHold,
    Episode,
    JumpHold,
    LRCut,
    PolicySnapshot,
    PolicyState,
    Probation,
)
from stability.types import Alarm, Alert, Control, Intervention

__all__ = [
    "STATE_VERSION", "CheckpointRef", "ClipHold", "Episode", "JumpHold", "LRCut", "Ledger",
    "Policy", "PolicyContext", "PolicySnapshot", "PolicyState", "Probation",
]


class Policy(ResponseMixin, RecoveryMixin):
    """Escalation-ladder policy; see the module docstring for the semantics.

    Parameters
    ----------
    config : dict, PolicyConfig or None
        The ``[policy]`` table (validated by :meth:`PolicyConfig.from_dict`).
    """

    def __init__(self, config: Mapping[str, Any] | PolicyConfig | None = None) -> None:
        self.config = config if isinstance(config, PolicyConfig) else PolicyConfig.from_dict(config)
        self.log_only = self.config.mode == "log_only"
        self._min_sev = SEV[self.config.min_severity]
        self.reset()

    # ------------------------------------------------------------------ the decision
    def step(
        self,
        step: int,
        alarms: Sequence[Alarm],
        control: Control,
        context: PolicyContext | Mapping[str, Any] | None = None,
    ) -> list[Intervention]:
        """Respond to the alarms of ``step``; mutate ``control`` (unless ``log_only``).

        Parameters
        ----------
        step : int
            The training step.
        alarms : sequence of Alarm
            The alarms of this step (empty on a quiet step).
        control : Control
            Per-step fields are set on alarm steps (never cleared: the monitor resets them);
            persistent ``lr_factor`` / ``clip_norm`` are written every call.
        context : PolicyContext or mapping, optional
            What the monitor knows of the run (:class:`PolicyContext`; a mapping with the same
            keys is converted): ``grad_norm``, ``grad_norm_recent_median``, ``clip_norm`` (the
            trainer's own clip), ``healthy_checkpoints`` (a :class:`Ledger`, e.g. a
            :class:`~stability.run.checkpoints.CheckpointLedger`), ``lr`` and ``lr_prev`` (the raw
            scheduler LR of this step and of the previous observed step, read on LR-jump alarm
            steps to size the cut exactly); all optional.  The policy notes alarm steps in the
            ledger, and rewinds it on a rollback when ``rewind_on_rollback``.

        Returns
        -------
        list of Intervention
            Empty on quiet and merged steps.
        """
        step = int(step)
        if control.stop and not self.log_only:
            return []  # track() stopped the run at this step: nothing else applies
        acts = [a for a in alarms if SEV.get(a.severity, 1) >= self._min_sev] if alarms else []
        if not acts:
            if not self.log_only:
                self._apply_persistent(step, control)
            return []
        ctx = PolicyContext.coerce(context)
        if ctx.healthy_checkpoints is not None:
            self.ledger = ctx.healthy_checkpoints
        cfg = self.config
        jcfg = cfg.lr_jump
        self._storm = False
        if cfg.lr_guard.enabled and self.guard.n >= cfg.lr_guard.min_steps:
            # the LR guard judges the requested LR itself, every step: LR-jump alarms are
            # recorded but do not act (a rewound scheduler, a benign restart, a step decay)
            acts = [a for a in acts if a.detector not in jcfg.detectors]
            if self.guard.active:
                # LR/loss anomalies while the guard holds an LR fault are that fault's echo
                acts = [a for a in acts if a.kind != "lr_loss_anomaly"]
            if not acts:
                if not self.log_only:
                    self._apply_persistent(step, control)
                return []
        if all(a.recovering for a in acts):
            return self._recovering_only(step, acts, ctx, control)
        ep = self._ep
        ep.consec = ep.consec + 1 if 0 < step - ep.last_seen <= 3 else 1
        ep.last_seen = step
        self._after = None  # the episode goes on: its aftermath is judged when it is over
        self._judged_onset = None
        rc = cfg.recovery
        cause = attribute(acts, lr_fault=self.guard.active,
                          nonfinite_loss_run=self.loss.nonfinite_run,
                          consecutive=ep.consec, persistent_after=rc.max_consecutive_skips)
        stop = self._overfit_stop(step, acts, cause, ctx, control)
        if stop is not None:
            return stop
        if cause == "data" and self._probation is not None:
            return self._data_keeps_failing(step, control)
        replayed = self._replayed_cause(step)
        if replayed:
            cause = replayed  # a rollback replayed a step fault: the same cause
        if not (cause == "divergence" and self.cause and self._onset is not None):
            self.cause = cause  # (a slow trend inside an episode keeps the episode's cause)
        damaged = False
        if jcfg.enabled:
            if any(a.kind in jcfg.damage_kinds for a in acts):
                self._damage_last = step
            damaged = (self._damage_last is not None
                       and 0 <= step - self._damage_last <= jcfg.damage_window)
        jump = self._jump_ratio(acts, ctx) if jcfg.enabled else None
        if jump is not None and self._rearm(step, jump):
            # the same LR jump still in force: the hold is extended; no new response
            acts = [a for a in acts if not self._is_jump(a)]
            jump = None
            if not acts:
                self.n_merged += 1
                self._update_neutral()
                if not self.log_only:
                    self._apply_persistent(step, control)
                return []
        by_kind: dict[str, list[Alarm]] = {}
        for a in acts:
            by_kind.setdefault(a.kind, []).append(a)
        kinds = sorted(by_kind)
        rules = {k: cfg.rule(k) for k in kinds}
        crit = {k: any(a.severity == "critical" for a in by_kind[k]) for k in kinds}
        skip = any(rules[k].skip == "always" or (rules[k].skip == "critical" and crit[k])
                   for k in kinds)

        persist = 0
        for k in kinds:
            r = rules[k]
            if r.patience > 0:
                h = [s for s in self._hist.get(k, []) if step - s < cfg.escalation_window]
                h = (h + [step])[-r.patience:]
                self._hist[k] = h
                if len(h) >= r.patience:
                    persist = max(persist, r.persist_level)

        actions: set[str] = set()
        esc = [k for k in kinds if rules[k].escalate]
        eff = self.level_at(step)
        responded = False
        if esc:
            ledger = ctx.healthy_checkpoints
            if ledger is not None:
                ledger.note_alarm(step)
            if eff == 0 or self._onset is None:
                self._onset = step
            start = max(rules[k].critical_start_level if crit[k] else rules[k].start_level
                        for k in esc)
            last = self._last_response
            in_cooldown = eff > 0 and last is not None and step - last < cfg.cooldown
            new = 0
            if in_cooldown:
                if persist > eff:
                    new = persist
            elif eff == 0:
                new = max(start, persist)
            else:
                up = last is not None and step - last <= cfg.escalation_window
                new = max(eff + 1 if up else eff, start, persist)
            self._last_alarm = step
            if new:
                new = min(new, len(cfg.ladder))
                self._level = new
                self._last_response = step
                responded = True
                for k in esc:
                    lad = rules[k].ladder or cfg.ladder
                    actions.update(lad[min(new, len(lad)) - 1])
            else:
                self._level = eff
        level_now = self.level_at(step)
        for k in kinds:
            if rules[k].escalate:
                continue
            last_k = self._kind_last.get(k)
            if last_k is None or not 0 <= step - last_k < cfg.cooldown:
                self._kind_last[k] = step
                responded = True
                lad = rules[k].ladder or cfg.ladder
                lvl = max(level_now, rules[k].critical_start_level if crit[k]
                          else rules[k].start_level)
                actions.update(lad[min(lvl, len(lad)) - 1])
        if jump is not None:
            # a new LR jump: a cut sized to it replaces the ladder's generic LR cut
            actions.update(("alert", "reduce_lr"))
            responded = True
            if damaged and jcfg.rollback_on_damage:
                actions.update(("checkpoint", "rollback"))
        nonfinite_now = "nonfinite" in kinds
        if skip and (cause == "shift" or replayed) and not nonfinite_now:
            # no skip storms: a persistent shift must be learned, not skipped; a replayed
            # deterministic fault is trained through (skipping cannot heal the weights)
            skip = False
        adapting = cause == "shift" or bool(replayed) or (
            cause == "overflow" and ep.consec > rc.max_consecutive_skips)
        if adapting and ep.adapt_start is None:
            self._start_adapting(step)
            actions.update(("alert", "clip", "reduce_lr"))
            responded = True
        if cause == "corruption" and not replayed:
            actions.update(("alert", "checkpoint", "rollback"))
            skip = True
            responded = True
        if cause == "data":
            # the canary (held-out early batches) diverged: the model is learning bad data
            actions.update(("alert", "rollback"))
            responded = True
        worse = self.worse()
        if "stop" in actions and not self._exhausted(step, ctx):
            # stop only when nothing is left to try: a rollback comes first
            actions = (actions - {"stop"}) | {"checkpoint", "rollback"}
        if "rollback" in actions and not self._storm and cause in (
                "shift", "overflow", "outlier", "divergence"):
            ok = worse is not False and (cause in ("outlier", "divergence") or (
                ep.adapt_start is not None and step - ep.adapt_start >= rc.adapt_steps
                and not self._improving()))
            if not ok:
                actions -= {"rollback", "checkpoint"}
                if ep.adapt_start is None:
                    self._start_adapting(step)
                    actions.update(("alert", "clip", "reduce_lr"))
        if skip:
            actions.add("skip")
            if self._skip_storm(step, ctx):
                actions = (actions - {"skip", "clip", "checkpoint"}) | (
                    {"alert", "stop"} if self._exhausted(step, ctx)
                    else {"alert", "rollback", "reduce_lr"})
                responded = True
        if responded:
            self.n_responses += 1
        else:
            self.n_merged += 1
        self._rewound_to = None
        ivs = self._build(step, actions, by_kind, max(level_now, 1), ctx, control, jump)
        if cause:
            ivs = [dataclasses.replace(iv, cause=cause) for iv in ivs]
        if self._rolled_back:
            # a new start from a healthy state: the episode and its escalation are over
            self._level = 0
            self._last_alarm = self._last_response = None
            self._hist = {}
            self._kind_last = {}
            self._onset = None
            if cause == "data":
                self._lr = self._clip = None  # the undone episode's responses go with it
            self._reset_episode()
            self.guard.rewind()
            self.val.rewind(self._rewound_to if self._rewound_to is not None else step)
        self._update_neutral()
        if not self.log_only:
            # after a rewinding rollback the trainer continues from the restored step
            self._apply_persistent(step if self._rewound_to is None else self._rewound_to,
                                   control)
        return ivs

    def _recovering_only(self, step: int, acts: Sequence[Alarm], ctx: PolicyContext,
                         control: Control) -> list[Intervention]:
        """Rule: an excursion already returning to trend is reported, never acted on.

        Every acting alarm of the step is ``recovering`` (its score has given back half of its
        episode's peak excess over the threshold, :mod:`stability.monitor.recovery`): the run is
        on its way back to its trajectory without help (invariants 1 and 3).  The response is
        at most a warning ``alert`` -- once per ``cooldown`` steps per kind, none inside the
        cooldown of a response -- and never a skip, clip, LR cut, checkpoint, rollback or stop.

        The escalation state is left alone: the level does not climb (and decays by the
        hysteresis, since a recovering alarm is not an alarm to it), no onset or cause is
        recorded.  The episode stays open -- the step counts in its run of consecutive alarm
        steps (what makes a shift persistent), its aftermath is judged and the loss baseline
        learns again only once it is over -- and the alarm step is noted in the checkpoint
        ledger.
        """
        ledger = ctx.healthy_checkpoints
        if ledger is not None:
            ledger.note_alarm(step)
        ep = self._ep
        ep.consec = ep.consec + 1 if 0 < step - ep.last_seen <= 3 else 1
        ep.last_seen = step
        if not self.log_only:
            self._apply_persistent(step, control)
        cd = self.config.cooldown
        last = self._last_response
        fresh = sorted({a.kind for a in acts if not 0 <= step - self._kind_last.get(
            a.kind, -INF_STEP) < cd})
        if not fresh or (last is not None and 0 <= step - last < cd):
            self.n_merged += 1
            return []
        for k in fresh:
            self._kind_last[k] = step
        reason = "recovering: " + "; ".join(
            f"{k}({', '.join(sorted({a.signal for a in acts if a.kind == k}))})" for k in fresh)
        msg = (f"step {step}: {reason} -> none (the excursion is returning to trend: "
               f"reported, not acted on)")
        return [Alert(step, reason, cause=self.cause, severity="warning", message=msg)]

    def _data_keeps_failing(self, step: int, control: Control) -> list[Intervention]:
        """The canary diverged again during the probation of a rollback that skipped bad data:
        the data source keeps failing -- stop with the probation's healthy target restored."""
        pb = self._probation
        assert pb is not None
        self._probation = None
        reason = (f"the canary loss diverged again {step - pb.resume} steps after the rollback "
                  f"at step {pb.resume} skipped the bad data: the data source keeps failing")
        return self._stop_restoring(step, pb.target, reason, "data", control)

    def _skip_storm(self, step: int, ctx: PolicyContext) -> bool:
        """Count this skipped step; ``True`` when the run has been skipping for
        ``recovery.max_skips`` consecutive steps (it is not training: escalate)."""
        ep = self._ep
        ep.skip_run = ep.skip_run + 1 if step - ep.last_skip == 1 else 1
        ep.last_skip = step
        if ep.skip_run < self.config.recovery.max_skips:
            return False
        self._storm = True
        return True

    def __repr__(self) -> str:
        return f"Policy(mode={self.config.mode!r}, level={self._level})"
