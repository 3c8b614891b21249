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

One class, in sections: the state and its pure queries (the records and the snapshot format
live in :mod:`stability.policy.state`), the escalation ladder (:meth:`Policy.step`), every-step
tracking with the recovery gates (probation, aftermath, the overfitting stop), and building a
response (actions -> interventions, LR-jump sizing); :mod:`stability.policy.context` holds the
:class:`PolicyContext` the monitor passes and the :class:`Ledger` protocol.

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
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from stability.policy.attribution import DATA_CAUSES, attribute
from stability.policy.config import ACTIONS, KindRule, PolicyConfig
from stability.policy.context import CheckpointRef, Ledger, PolicyContext, finite_or_none
from stability.policy.loss_tracker import CanaryTracker, LossTracker, ValTracker
from stability.policy.lr_guard import LRGuard
from stability.policy.lr_schedule import adaptive_clip, compound_factor, lr_cut_end, lr_factor_at
from stability.policy.state import (
    INF_STEP,
    STATE_VERSION,
    Aftermath,
    ClipHold,
    Episode,
    JumpHold,
    LRCut,
    PolicySnapshot,
    Probation,
    read_state,
    write_state,
)
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

__all__ = [
    "STATE_VERSION", "CheckpointRef", "ClipHold", "Episode", "JumpHold", "LRCut", "Ledger",
    "Policy", "PolicyContext", "PolicySnapshot", "Probation",
]

#: severity name -> rank
SEV = {s: i for i, s in enumerate(SEVERITIES)}

def _signals(alarms: Iterable[Alarm], limit: int = 3) -> str:
    sig = sorted({a.signal for a in alarms})
    more = f", +{len(sig) - limit}" if len(sig) > limit else ""
    return ", ".join(sig[:limit]) + more

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


@dataclasses.dataclass
class _Draft:
    """The response being decided for one alarm step.

    :meth:`Policy.step` passes it from rule to rule; each rule reads it and refines it, and
    :meth:`Policy._build` turns the final ``actions`` into interventions.
    """

    step: int
    acts: list[Alarm]
    ctx: PolicyContext
    control: Control
    #: this step's cause (attributed, or the cause of the fault a rollback replayed)
    cause: str
    #: the cause of the step-fault episode a rollback undid and this one replays (``None``: none)
    replayed: str | None
    #: ratio of a new LR jump to size a cut to (``None``: no new jump)
    jump: float | None = None
    #: damage alarms came within ``lr_jump.damage_window`` steps
    damaged: bool = False
    by_kind: dict[str, list[Alarm]] = dataclasses.field(default_factory=dict)
    rules: dict[str, KindRule] = dataclasses.field(default_factory=dict)
    #: kind -> whether one of its alarms is critical
    crit: dict[str, bool] = dataclasses.field(default_factory=dict)
    #: skip this optimizer step
    skip: bool = False
    actions: set[str] = dataclasses.field(default_factory=set)
    #: a new response (``False``: merged into the last one)
    responded: bool = False
    #: the escalation level of the response (after the ladder)
    level: int = 0
    #: the rollback restores the weights keeping the position (a replayed fault in them)
    keep_position: bool = False

    @property
    def kinds(self) -> list[str]:
        """The alarm kinds of the step, sorted."""
        return sorted(self.by_kind)


class Policy:
    """Escalation-ladder policy; see the module docstring for the semantics.

    Parameters
    ----------
    config : dict, PolicyConfig or None
        The ``[policy]`` table (validated by :meth:`PolicyConfig.from_dict`).
    """

    # ================================================================== state and queries

    config: PolicyConfig
    log_only: bool
    #: the checkpoint ledger (set by the monitor; also taken from each step's context)
    ledger: Ledger | None = None

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every incident (fresh state)."""
        self._level = 0
        self._last_alarm: int | None = None
        self._last_response: int | None = None
        self._kind_last: dict[str, int] = {}
        self._onset: int | None = None
        self._hist: dict[str, list[int]] = {}
        self._lr: LRCut | None = None
        self._clip: ClipHold | None = None
        self._neutral_from = -INF_STEP
        self._rewound_to: int | None = None
        self._jump: JumpHold | None = None
        self._damage_last: int | None = None
        self._rolled_back = False
        self._probation: Probation | None = None
        self._after: Aftermath | None = None
        self._judged_onset: int | None = None  # the episode whose aftermath was judged
        self.n_undo = 0
        #: (onset, cause) of step-fault episodes undone by a rollback
        self._rb_onsets: list[tuple[int, str]] = []
        #: onsets of replayed faults answered by a restore that kept the position
        self._kept_onsets: list[int] = []
        self._storm = False  # this step's response is a skip storm's escalation
        self.n_rollbacks = 0
        self.n_responses = 0
        self.n_merged = 0
        self.guard = LRGuard(self.config.lr_guard)
        self._ep = Episode()
        rc = self.config.recovery
        self.loss = LossTracker(rc.fast_alpha, rc.base_alpha)
        self.val = ValTracker(rc.val_margin)
        self.canary = CanaryTracker()

    def _reset_episode(self) -> None:
        """Forget the open episode (after a rollback, or when it is over)."""
        self._ep = Episode()

    @property
    def cause(self) -> str:
        """Attributed cause of the open (or latest) episode (``""``: none)."""
        return self._ep.cause

    @cause.setter
    def cause(self, value: str) -> None:
        self._ep.cause = value

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state (``"version"`` key); config is not included."""
        return write_state(PolicySnapshot(
            level=self._level, last_alarm=self._last_alarm, last_response=self._last_response,
            kind_last=self._kind_last, onset=self._onset, hist=self._hist, lr=self._lr,
            clip=self._clip, jump=self._jump, damage_last=self._damage_last,
            n_rollbacks=self.n_rollbacks, n_responses=self.n_responses, n_merged=self.n_merged,
            guard=self.guard, episode=self._ep, probation=self._probation, loss=self.loss,
            val=self.val, aftermath=self._after, judged_onset=self._judged_onset,
            n_undo=self.n_undo, rb_onsets=self._rb_onsets, kept_onsets=self._kept_onsets,
            canary=self.canary))

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; later decisions are identical.

        This policy's configuration wins (it is not part of the snapshot).  Every field is
        checked before anything changes: a malformed one (a NaN or negative LR factor, a
        negative hold, a tuple of the wrong length, ...) raises ``ValueError`` naming it and
        leaves the policy as it was.
        """
        s = read_state(sd, self.config)
        self.reset()
        self._level, self._last_alarm, self._last_response = (
            s.level, s.last_alarm, s.last_response)
        self._kind_last, self._onset, self._hist = s.kind_last, s.onset, s.hist
        self._lr, self._clip, self._jump, self._damage_last = s.lr, s.clip, s.jump, s.damage_last
        self.n_rollbacks, self.n_responses, self.n_merged = (
            s.n_rollbacks, s.n_responses, s.n_merged)
        self.guard, self.loss, self.val = s.guard, s.loss, s.val
        self._ep, self._probation = s.episode, s.probation
        self._after, self._judged_onset, self.n_undo = s.aftermath, s.judged_onset, s.n_undo
        self._rb_onsets = list(s.rb_onsets)
        self._kept_onsets = list(s.kept_onsets)
        self.canary = s.canary
        self._update_neutral()

    # ------------------------------------------------------------------ pure queries
    def level_at(self, step: int) -> int:
        """Escalation level at ``step`` after hysteresis decay (0 = no incident).

        >>> from stability.policy.policy import Policy
        >>> Policy({"quiet_steps": 10}).level_at(5)
        0
        """
        if self._last_alarm is None or self._level == 0:
            return 0
        quiet = max(step - self._last_alarm, 0)
        return max(0, self._level - quiet // self.config.quiet_steps)

    def lr_factor_at(self, step: int) -> float:
        """LR multiplier the policy wants at ``step`` (ignores ``log_only``)."""
        g = self.guard.factor if self.guard.active else 1.0
        return min(g, self._ladder_lr_factor_at(step))

    def _ladder_lr_factor_at(self, step: int) -> float:
        """The ladder's own LR cut at ``step`` (without the LR guard's)."""
        if self._lr is None:
            return 1.0
        s, f, d, r = self._lr
        return lr_factor_at(step, s, f, d, r, self.config.lr.shape)

    def clip_norm_at(self, step: int) -> float | None:
        """Clip norm the policy wants at ``step`` (``None``: trainer default; ignores log_only)."""
        if self._clip is None:
            return None
        norm, start, duration = self._clip
        if step < start or (duration > 0 and step >= start + duration):
            return None
        return norm

    def planned_control_at(self, step: int) -> Control:
        """Persistent fields the policy wants at ``step``, whatever the mode."""
        return Control(lr_factor=self.lr_factor_at(step), clip_norm=self.clip_norm_at(step))

    def control_at(self, step: int) -> Control:
        """Persistent ``Control`` fields (``lr_factor``, ``clip_norm``) at ``step``.

        A pure function of (state, step): exactly what ``step()`` writes on a step without
        alarms.  Neutral in ``log_only`` mode.
        """
        return Control() if self.log_only else self.planned_control_at(step)

    def worse(self) -> bool | None:
        """Is the run measurably worse than before the episode?  ``None``: cannot tell."""
        return self.loss.worse(self.config.recovery.worse_margin)

    def _apply_persistent(self, step: int, control: Control) -> None:
        if step >= self._neutral_from and not self.guard.active:
            control.lr_factor, control.clip_norm = 1.0, None
        else:
            control.lr_factor = self.lr_factor_at(step)
            control.clip_norm = self.clip_norm_at(step)

    def _update_neutral(self) -> None:
        ends = [-INF_STEP]
        if self._lr is not None:
            ends.append(lr_cut_end(self._lr.start, self._lr.duration, self._lr.restore))
        if self._clip is not None:
            c = self._clip
            ends.append(INF_STEP if c.duration == 0 else c.start + c.duration)
        self._neutral_from = max(ends)

    def _rewind(self, step: int, to: int, ledger: Ledger | None) -> None:
        """The trainer restarts counting at ``to + 1``: shift every timestamp by ``to - step``."""
        d = to - step

        def sh(x: int | None) -> int | None:
            return None if x is None else x + d

        self._last_alarm = sh(self._last_alarm)
        self._last_response = sh(self._last_response)
        self._kind_last = {k: v + d for k, v in self._kind_last.items()}
        self._hist = {k: [x + d for x in v] for k, v in self._hist.items()}
        if self._lr is not None:
            self._lr = self._lr._replace(start=self._lr.start + d)
        if self._clip is not None:
            self._clip = self._clip._replace(start=self._clip.start + d)
        if self._jump is not None:
            self._jump = self._jump._replace(last=self._jump.last + d)
        self._damage_last = sh(self._damage_last)
        if ledger is not None:
            ledger.rewind(to)

    # ================================================================== the escalation ladder

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

        The body is the ordered list of the policy's rules, one method each (the docs page
        ``docs/policy.md`` lists them): filter the alarms, open the episode and attribute it,
        the early stops, then the rules that draft this step's actions, then the response.

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
        acts = self._severe_enough(alarms)
        if not acts:
            return self._hold(step, control)
        ctx = self._take_context(context)
        acts = self._lr_guard_filter(acts)
        if not acts:
            return self._hold(step, control)
        if all(a.recovering for a in acts):
            return self._recovering_only(step, acts, ctx, control)
        self._continue_episode(step)
        cause = self._attribute(acts)
        stop = self._overfit_stop(step, acts, cause, ctx, control)
        if stop is not None:
            return stop
        if cause == "data" and self._probation is not None:
            return self._data_keeps_failing(step, control)
        d = _Draft(step, acts, ctx, control, *self._episode_cause(step, cause))
        self._note_damage(d)
        if self._rearm_held_jump(d):
            return self._merge_rearmed_jump(step, control)
        self._group_by_kind(d)
        self._skip_rule(d)
        self._escalation_ladder(d, self._persist_level(d))
        self._non_escalating_kinds(d)
        self._cut_to_the_jump(d)
        self._train_through_a_shift(d)
        self._adapt_to_a_shift(d)
        self._roll_back_corruption(d)
        self._roll_back_bad_data(d)
        self._rollback_before_stop(d)
        self._rollback_gate(d)
        self._skip_storm_escalates(d)
        return self._respond(d)

    # ------------------------------------------------------------------ which alarms act
    def _severe_enough(self, alarms: Sequence[Alarm]) -> list[Alarm]:
        """Rule: alarms below ``min_severity`` are recorded, never acted on."""
        if not alarms:
            return []
        return [a for a in alarms if SEV.get(a.severity, 1) >= self._min_sev]

    def _hold(self, step: int, control: Control) -> list[Intervention]:
        """A step with nothing to act on: only the persistent ``Control`` fields are written."""
        if not self.log_only:
            self._apply_persistent(step, control)
        return []

    def _take_context(self, context: PolicyContext | Mapping[str, Any] | None) -> PolicyContext:
        """Coerce the monitor's context; its ledger becomes the policy's; a new step's
        response is no skip storm's (yet)."""
        ctx = PolicyContext.coerce(context)
        if ctx.healthy_checkpoints is not None:
            self.ledger = ctx.healthy_checkpoints
        self._storm = False
        return ctx

    def _lr_guard_filter(self, acts: list[Alarm]) -> list[Alarm]:
        """Rule: once the LR guard is warm it judges the requested LR itself, every step.

        LR-jump alarms are then recorded but do not act (a rewound scheduler, a benign restart,
        a step decay), and LR/loss anomalies while the guard holds an LR fault are that fault's
        echo.
        """
        cfg = self.config
        if not (cfg.lr_guard.enabled and self.guard.n >= cfg.lr_guard.min_steps):
            return acts
        acts = [a for a in acts if a.detector not in cfg.lr_jump.detectors]
        if self.guard.active:
            acts = [a for a in acts if a.kind != "lr_loss_anomaly"]
        return acts

    # ------------------------------------------------------------------ episode and cause
    def _count_consecutive(self, step: int) -> None:
        """Count the alarm step in the episode's run of consecutive alarm steps (gaps of at
        most 3 steps keep the run going): what makes a shift persistent."""
        ep = self._ep
        ep.consec = ep.consec + 1 if 0 < step - ep.last_seen <= 3 else 1
        ep.last_seen = step

    def _continue_episode(self, step: int) -> None:
        """Rule: an acting alarm continues the episode; its aftermath is judged when it is
        over, so a pending judgement is dropped."""
        self._count_consecutive(step)
        self._after = None
        self._judged_onset = None

    def _attribute(self, acts: Sequence[Alarm]) -> str:
        """The cause of this step's alarms (:func:`~stability.policy.attribution.attribute`)."""
        return attribute(acts, lr_fault=self.guard.active,
                         nonfinite_loss_run=self.loss.nonfinite_run,
                         consecutive=self._ep.consec,
                         persistent_after=self.config.recovery.max_consecutive_skips)

    def _episode_cause(self, step: int, cause: str) -> tuple[str, str | None]:
        """Rule: a rollback that replayed a step fault keeps that fault's cause; a slow trend
        (``divergence``) inside an open episode keeps the episode's cause.

        Returns this step's cause and the replayed one (``None``: no replay).
        """
        replayed = self._replayed_cause(step)
        if replayed:
            cause = replayed
        if not (cause == "divergence" and self.cause and self._onset is not None):
            self.cause = cause
        return cause, replayed

    # ------------------------------------------------------------------ LR jumps (step)
    def _note_damage(self, d: _Draft) -> None:
        """Rule: remember when damage alarms (loss spike, gradient explosion, ...) last came,
        so an LR jump within ``lr_jump.damage_window`` of them also rolls back."""
        jcfg = self.config.lr_jump
        if not jcfg.enabled:
            return
        if any(a.kind in jcfg.damage_kinds for a in d.acts):
            self._damage_last = d.step
        d.damaged = (self._damage_last is not None
                     and 0 <= d.step - self._damage_last <= jcfg.damage_window)

    def _rearm_held_jump(self, d: _Draft) -> bool:
        """Rule: an alarm of the LR jump already held extends its hold, no new response.

        Sizes ``d.jump`` for a new jump; ``True`` when nothing but re-armed jump alarms is left.
        """
        if not self.config.lr_jump.enabled:
            return False
        d.jump = self._jump_ratio(d.acts, d.ctx)
        if d.jump is None or not self._rearm(d.step, d.jump):
            return False
        d.acts = [a for a in d.acts if not self._is_jump(a)]
        d.jump = None
        return not d.acts

    def _merge_rearmed_jump(self, step: int, control: Control) -> list[Intervention]:
        """The step only re-armed a held jump: merged into its response."""
        self.n_merged += 1
        self._update_neutral()
        return self._hold(step, control)

    # ------------------------------------------------------------------ per-kind rules
    def _group_by_kind(self, d: _Draft) -> None:
        """Group the acting alarms by kind, with each kind's rule and whether it is critical."""
        for a in d.acts:
            d.by_kind.setdefault(a.kind, []).append(a)
        d.rules = {k: self.config.rule(k) for k in d.kinds}
        d.crit = {k: any(a.severity == "critical" for a in d.by_kind[k]) for k in d.kinds}

    def _skip_rule(self, d: _Draft) -> None:
        """Rule: the optimizer step is skipped when a kind's ``skip`` rule matches
        (``always``, or ``critical`` on a critical alarm), whatever the level."""
        d.skip = any(d.rules[k].skip == "always"
                     or (d.rules[k].skip == "critical" and d.crit[k]) for k in d.kinds)

    def _persist_level(self, d: _Draft) -> int:
        """Rule: ``patience`` alarm steps of a kind within ``escalation_window`` jump to at
        least its ``persist_level``, even inside a cooldown (0: no kind persists)."""
        persist = 0
        for k in d.kinds:
            r = d.rules[k]
            if r.patience <= 0:
                continue
            h = [s for s in self._hist.get(k, []) if d.step - s < self.config.escalation_window]
            h = (h + [d.step])[-r.patience:]
            self._hist[k] = h
            if len(h) >= r.patience:
                persist = max(persist, r.persist_level)
        return persist

    def _start_level(self, d: _Draft, kind: str) -> int:
        """The level a kind's response starts at (its critical start on a critical alarm)."""
        r = d.rules[kind]
        return r.critical_start_level if d.crit[kind] else r.start_level

    def _rung(self, d: _Draft, kind: str, level: int) -> tuple[str, ...]:
        """The actions of ``level`` in the kind's ladder (a shorter ladder stays at its top)."""
        lad = d.rules[kind].ladder or self.config.ladder
        return tuple(lad[min(level, len(lad)) - 1])

    def _escalation_ladder(self, d: _Draft, persist: int) -> None:
        """Rule: the escalating kinds share one level; a response takes its rung's actions.

        The alarm step is noted in the ledger and opens the episode's onset when no incident
        is open; the new level is :meth:`_next_level`'s (0: merged into the last response).
        """
        esc = [k for k in d.kinds if d.rules[k].escalate]
        if not esc:
            return
        if d.ctx.healthy_checkpoints is not None:
            d.ctx.healthy_checkpoints.note_alarm(d.step)
        eff = self.level_at(d.step)
        if eff == 0 or self._onset is None:
            self._onset = d.step
        new = self._next_level(d.step, eff, max(self._start_level(d, k) for k in esc), persist)
        self._last_alarm = d.step
        if not new:
            self._level = eff
            return
        new = min(new, len(self.config.ladder))
        self._level = new
        self._last_response = d.step
        d.responded = True
        for k in esc:
            d.actions.update(self._rung(d, k, new))

    def _next_level(self, step: int, eff: int, start: int, persist: int) -> int:
        """Rule: cooldown and escalation (0: no new response).

        Inside ``cooldown`` steps of the last response the alarm is merged (unless a kind
        persists above the level); a first response starts at ``start``; a response within
        ``escalation_window`` of the previous one goes one level up, a later one repeats it.
        """
        cfg = self.config
        last = self._last_response
        if eff > 0 and last is not None and step - last < cfg.cooldown:
            return persist if persist > eff else 0
        if eff == 0:
            return max(start, persist)
        up = last is not None and step - last <= cfg.escalation_window
        return max(eff + 1 if up else eff, start, persist)

    def _non_escalating_kinds(self, d: _Draft) -> None:
        """Rule: a kind with ``escalate = false`` responds on its own cooldown, at the shared
        level or its start level (whichever is higher), and never raises the level."""
        d.level = self.level_at(d.step)  # the level of this step's response
        for k in d.kinds:
            if d.rules[k].escalate:
                continue
            last_k = self._kind_last.get(k)
            if last_k is not None and 0 <= d.step - last_k < self.config.cooldown:
                continue
            self._kind_last[k] = d.step
            d.responded = True
            d.actions.update(self._rung(d, k, max(d.level, self._start_level(d, k))))

    # ------------------------------------------------------------------ cause-specific rules
    def _cut_to_the_jump(self, d: _Draft) -> None:
        """Rule: a new LR jump gets a cut sized to it (replacing the ladder's generic cut),
        plus a checkpoint + rollback when damage alarms came first."""
        if d.jump is None:
            return
        d.actions.update(("alert", "reduce_lr"))
        d.responded = True
        if d.damaged and self.config.lr_jump.rollback_on_damage:
            d.actions.update(("checkpoint", "rollback"))

    def _train_through_a_shift(self, d: _Draft) -> None:
        """Rule: no skip storms -- a persistent shift must be learned, not skipped, and a
        replayed deterministic fault is trained through (skipping cannot heal the weights);
        a non-finite value is still skipped."""
        if d.skip and (d.cause == "shift" or d.replayed) and "nonfinite" not in d.by_kind:
            d.skip = False

    def _adapt_to_a_shift(self, d: _Draft) -> None:
        """Rule: a shift, a replayed fault, or an overflow that persists past
        ``recovery.max_consecutive_skips`` starts adapting once per episode (clip + LR cut)."""
        ep = self._ep
        adapting = d.cause == "shift" or bool(d.replayed) or (
            d.cause == "overflow" and ep.consec > self.config.recovery.max_consecutive_skips)
        if adapting and ep.adapt_start is None:
            self._start_adapting(d.step)
            d.actions.update(("alert", "clip", "reduce_lr"))
            d.responded = True

    def _roll_back_corruption(self, d: _Draft) -> None:
        """Rule: corrupted state rolls back at once (the step skipped); when a rollback already
        replayed it (deterministic), once more but without replaying its step
        (:meth:`_may_keep_position`)."""
        if d.cause == "corruption" and (not d.replayed or self._may_keep_position(d.step)):
            d.actions.update(("alert", "checkpoint", "rollback"))
            d.skip = True
            d.responded = True

    def _roll_back_bad_data(self, d: _Draft) -> None:
        """Rule: the canary (held-out early batches) diverged -- the model is learning bad data:
        roll back."""
        if d.cause == "data":
            d.actions.update(("alert", "rollback"))
            d.responded = True

    def _rollback_before_stop(self, d: _Draft) -> None:
        """Rule: stop only when nothing is left to try -- a rollback comes first."""
        if "stop" in d.actions and not self._exhausted(d.step, d.ctx):
            d.actions = (d.actions - {"stop"}) | {"checkpoint", "rollback"}

    def _rollback_gate(self, d: _Draft) -> None:
        """Rule: a shift, overflow, outlier or divergence rolls back only when it has earned it
        (:meth:`_rollback_earned`); otherwise it adapts instead (once per episode)."""
        if "rollback" not in d.actions or d.cause not in (
                "shift", "overflow", "outlier", "divergence"):
            return
        if self._rollback_earned(d):
            return
        d.actions -= {"rollback", "checkpoint"}
        if self._ep.adapt_start is None:
            self._start_adapting(d.step)
            d.actions.update(("alert", "clip", "reduce_lr"))

    def _rollback_earned(self, d: _Draft) -> bool:
        """The run is not measurably better than before the episode, and either the cause is an
        outlier / divergence or adapting for ``recovery.adapt_steps`` did not improve it."""
        if self.worse() is False:
            return False
        if d.cause in ("outlier", "divergence"):
            return True
        ep = self._ep
        return (ep.adapt_start is not None
                and d.step - ep.adapt_start >= self.config.recovery.adapt_steps
                and not self._improving())

    def _skip_storm_escalates(self, d: _Draft) -> None:
        """Rule: skip the step; ``recovery.max_skips`` consecutive skips are a storm (the run
        is not training): a rollback with an LR cut, or a stop when none is left."""
        if not d.skip:
            return
        d.actions.add("skip")
        if not self._skip_storm(d.step, d.ctx):
            return
        d.actions = (d.actions - {"skip", "clip", "checkpoint"}) | (
            {"alert", "stop"} if self._exhausted(d.step, d.ctx)
            else {"alert", "rollback", "reduce_lr"})
        d.responded = True

    # ------------------------------------------------------------------ the response
    def _respond(self, d: _Draft) -> list[Intervention]:
        """Count the response (or the merge), build its interventions tagged with the cause,
        reset after a rollback, and write the persistent ``Control`` fields."""
        if d.responded:
            self.n_responses += 1
        else:
            self.n_merged += 1
        self._rewound_to = None
        ivs = self._build(d)
        if d.cause:
            ivs = [dataclasses.replace(iv, cause=d.cause) for iv in ivs]
        if self._rolled_back:
            self._reset_after_rollback(d)
        self._update_neutral()
        if not self.log_only:
            # after a rewinding rollback the trainer continues from the restored step
            self._apply_persistent(d.step if self._rewound_to is None else self._rewound_to,
                                   d.control)
        return ivs

    def _reset_after_rollback(self, d: _Draft) -> None:
        """Rule: a rollback is a new start from a healthy state -- the episode and its
        escalation are over (a data episode's LR cut and clip go with it)."""
        self._level = 0
        self._last_alarm = self._last_response = None
        self._hist = {}
        self._kind_last = {}
        self._onset = None
        if d.cause == "data":
            self._lr = self._clip = None  # the undone episode's responses go with it
        self._reset_episode()
        self.guard.rewind()
        self.val.rewind(self._rewound_to if self._rewound_to is not None else d.step)
        self.canary.rewind(self._rewound_to if self._rewound_to is not None else d.step)

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
        self._count_consecutive(step)
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

    # ================================================================ tracking and recovery gates

    # ------------------------------------------------------------------ every step
    def note_canary(self, step: int, value: float) -> None:
        """A canary evaluation (``canary_loss``) at ``step``: where its climb began is a data
        rollback's bound (:meth:`_rollback_target`).  The monitor calls it on every step that
        carries one."""
        self.canary.update(step, value)

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

        The open episode's onset, the checkpoint an open probation would restore on its stop
        (invariant 2: a stop restores it, so retention must keep it) and the step after the
        best validation point: the latest healthy checkpoint before each must survive
        checkpoint retention.
        """
        out = [] if self._onset is None else [self._onset]
        if self._probation is not None:
            out.append(self._probation.target + 1)
        if self._after is not None:
            out.append(self._after.onset)
        if self.guard.active and self.guard.onset >= 0:
            out.append(self.guard.onset)
        if self.val.best_step >= 0:
            out.append(self.val.best_step + 1)
        if self.canary.low_step >= 0:  # a data rollback's bound (the canary last vouched)
            out.append(self.canary.low_step)
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
            self.loss.rewind()
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

    # ================================================================== building a response

    def _build(self, d: _Draft) -> list[Intervention]:
        """Turn the drafted actions into interventions and ``Control`` fields.

        The last gates first (:meth:`_gate_rollback`, :meth:`_gate_stop`: they may turn a
        rollback into a stop or drop one, with a note), then one intervention per action in
        a fixed order, the alert (with every note) in front.
        """
        self._rolled_back = False
        notes: list[str] = []
        reason = f"L{max(d.level, 1)}: " + "; ".join(
            f"{k}({_signals(v)})" for k, v in sorted(d.by_kind.items()))
        self._gate_rollback(d, notes)
        self._gate_stop(d, notes)
        out: list[Intervention] = []
        for emit in (self._emit_skip, self._emit_clip, self._emit_lr_cut, self._emit_checkpoint,
                     self._emit_rollback, self._emit_stop):
            out += emit(d, reason, notes)
        return self._emit_alert(d, reason, notes) + out

    # ------------------------------------------------------------------ last gates
    def _gate_rollback(self, d: _Draft, notes: list[str]) -> None:
        """Rules: a rollback is never repeated over a deterministic fault, never past
        ``max_rollbacks`` (a stop instead), and needs a healthy checkpoint before the onset."""
        self._rerun_verdict(d, notes)
        if "rollback" in d.actions and self.n_rollbacks >= self.config.max_rollbacks:
            d.actions = (d.actions - {"rollback"}) | {"stop"}
            notes.append(f"rollback limit ({self.config.max_rollbacks}) reached")
        if "rollback" in d.actions and self._rollback_target(d) is None:
            d.actions = d.actions - {"rollback"}
            notes.append(f"no healthy checkpoint before onset {self._onset_or(d.step)}: "
                         f"cannot roll back")
            if self.cause == "corruption":  # a broken state with nothing to restore
                d.actions = d.actions | {"stop"}

    def _rerun_verdict(self, d: _Draft, notes: list[str]) -> None:
        """Rule: the same fault at the same step after a rollback to before it is deterministic
        -- another rollback would replay it (invariant 6: not repeated).  A fault in the model
        state gets the healthy weights back *without* replaying its step
        (:meth:`_may_keep_position`, no clip or LR cut with it); any other is trained through,
        or stopped in a skip storm."""
        if "rollback" not in d.actions or not self._recurs(d.step):
            return
        if self._may_keep_position(d.step):
            d.keep_position = True
            d.actions = d.actions - {"clip", "reduce_lr"}
            notes.append(f"the fault recurred at step {self._onset_or(d.step)} after a rollback "
                         f"to before it: deterministic -- restoring the healthy weights without "
                         f"replaying the step")
            return
        d.actions = d.actions - {"rollback", "checkpoint"}
        if self._storm:
            d.actions |= {"stop"}
        notes.append(f"the fault recurred at step {self._onset_or(d.step)} after a rollback to "
                     f"before it: deterministic, a rollback does not help -- "
                     + ("stopping" if self._storm else "training through it"))

    def _gate_stop(self, d: _Draft, notes: list[str]) -> None:
        """Rule: stop only when the run is measurably worse than before the episode (a skip
        storm and bad data stop anyway); the note says what was tried."""
        if "stop" not in d.actions:
            return
        if self.worse() is False and not self._storm and self.cause != "data":
            d.actions = d.actions - {"stop"}
            notes.append("would stop, but the run is not measurably worse than before the "
                         "episode: continuing")
            return
        tried = f"{self.n_rollbacks} rollback(s)"
        if self._ep.adapt_start is not None:
            tried += f", adapting since step {self._ep.adapt_start}"
        notes.append(f"cause: {self.cause or 'unknown'}; tried: {tried}")

    def _onset_or(self, step: int) -> int:
        """The open episode's onset (``step`` when none is recorded)."""
        return step if self._onset is None else self._onset

    def _rollback_target(self, d: _Draft) -> CheckpointRef | None:
        """The latest healthy checkpoint before the episode's onset (``None``: none); for bad
        data seen by the canary, also before the canary's climb began (the weights it last
        vouched for: :class:`~stability.policy.loss_tracker.CanaryTracker`)."""
        ledger = d.ctx.healthy_checkpoints
        before = self._onset_or(d.step)
        if self.cause == "data" and self.canary.low_step >= 0:
            before = min(before, self.canary.low_step)
        return None if ledger is None else ledger.latest_healthy_before(
            before, self.config.checkpoint_margin)

    # ------------------------------------------------------------------ one action each
    def _emit_skip(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``skip``: skip this optimizer step."""
        if "skip" not in d.actions:
            return []
        if not self.log_only:
            d.control.skip_step = True
        return [SkipStep(d.step, reason)]

    def _emit_clip(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``clip``: ``clip.factor`` x the recent median gradient norm, never above the clip in
        force, held for ``clip.duration`` steps."""
        if "clip" not in d.actions:
            return []
        c = self.config.clip
        current = self.clip_norm_at(d.step)
        if current is None:
            current = finite_or_none(d.ctx.clip_norm)
        med = finite_or_none(d.ctx.grad_norm_recent_median)
        norm = adaptive_clip(med, c.factor, current, tighten=c.tighten,
                             min_norm=c.min_norm, max_norm=c.max_norm)
        if norm is None:
            notes.append("no gradient statistics to derive a clip from")
            return []
        self._clip = ClipHold(norm, d.step, c.duration)
        return [SetClip(d.step, reason, max_norm=norm, duration=c.duration)]

    def _emit_lr_cut(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``reduce_lr``: a cut sized to a new LR jump, else the ladder's compounding cut."""
        if "reduce_lr" not in d.actions:
            return []
        if d.jump is not None:
            return self._jump_cut(d.step, d.jump, reason, notes)
        lr = self.config.lr
        f = compound_factor(self._ladder_lr_factor_at(d.step), lr.factor, lr.min_factor)
        self._lr = LRCut(d.step, f, lr.duration, lr.restore_steps)
        return [ReduceLR(d.step, reason, factor=f, duration=lr.duration,
                         restore_steps=lr.restore_steps)]

    def _jump_cut(self, step: int, jump: float, reason: str,
                  notes: list[str]) -> list[Intervention]:
        """The LR factor in force times ``min(1/jump, lr.factor)`` (floored at
        ``lr.min_factor``), held until ``lr_jump.hold`` steps after the last jump alarm."""
        cfg = self.config
        j = cfg.lr_jump
        held = self._jump_active(step)
        total = jump * (held.ratio if held is not None else 1.0)
        f = max(cfg.lr.min_factor,
                min(1.0, self.lr_factor_at(step)) * min(1.0 / jump, cfg.lr.factor))
        self._jump = JumpHold(total, step, f)
        self._lr = LRCut(step, f, j.hold, j.restore_steps)
        notes.append(f"LR jumped x{jump:.3g}: LR factor {f:.3g}, held until {j.hold} steps "
                     f"after the last jump alarm")
        return [ReduceLR(step, reason, factor=f, duration=j.hold, restore_steps=j.restore_steps)]

    def _emit_checkpoint(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``checkpoint``: an emergency checkpoint, tagged unhealthy."""
        if "checkpoint" not in d.actions:
            return []
        if not self.log_only:
            d.control.save_checkpoint = True
            d.control.checkpoint_reason = reason
        return [Checkpoint(d.step, reason, healthy=False)]

    def _emit_rollback(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``rollback``: to the latest healthy checkpoint before the onset, skipping the
        batches ``[onset, now]`` when the cause is in the data (or unknown); a step fault's
        onset is remembered (a replay there is deterministic)."""
        if "rollback" not in d.actions:
            return []
        onset = self._onset_or(d.step)
        target = self._rollback_target(d)
        if target is None:
            notes.append(f"no healthy checkpoint before onset {onset}: cannot roll back")
            return []
        if d.keep_position:
            return self._restore_keeping_position(d, reason, target)
        skip_data = self.cause in DATA_CAUSES or not self.cause
        if self.cause == "data" and self._onset is None:
            # no alarm marks where the bad data began: skip every batch since the
            # restored checkpoint (the canary vouched for none after it)
            onset = target.covers + 1
        self.n_rollbacks += 1
        if not skip_data:
            self._note_rolled_back(onset)
        self._onset = None
        self._rolled_back = True  # log_only decides as if it had acted
        self._start_probation(d.step, target, skip_data)
        if not self.log_only:
            self._restore(d, target, (onset, d.step) if skip_data else None)
        return [Rollback(d.step, reason, to_step=target.step, skip_from=onset,
                         skip_to=d.step if skip_data else onset - 1)]

    def _start_probation(self, step: int, target: CheckpointRef, skip_data: bool) -> None:
        """Rule: a rollback that skipped data of a known cause is on probation from where
        training resumes (the data source failing again stops the run)."""
        act = not self.log_only
        resume = target.covers if act and self.config.rewind_on_rollback else step
        self._probation = (Probation(resume, target.step, 0, self.cause)
                           if skip_data and self.cause else None)

    def _restore(self, d: _Draft, target: CheckpointRef,
                 skip_batches: tuple[int, int] | None) -> None:
        """Ask the trainer to restore ``target`` (and skip the batches); rewind the clocks when
        ``rewind_on_rollback``; the recent loss level restarts at the restored weights'."""
        d.control.rollback_to = target.step
        d.control.skip_batches = skip_batches
        self.loss.rewind()
        if self.config.rewind_on_rollback:
            self._rewind(d.step, target.covers, d.ctx.healthy_checkpoints)
            self._rewound_to = target.covers

    def _emit_stop(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``stop``: with the latest healthy weights restored (:meth:`_stop_restore`)."""
        if "stop" not in d.actions:
            return []
        out = self._stop_restore(d.step, d.ctx.healthy_checkpoints, notes, d.control)
        out.append(Stop(d.step, reason + ("; " + "; ".join(notes) if notes else "")))
        if not self.log_only:
            d.control.stop = True
            d.control.stop_reason = out[-1].reason
        return out

    def _emit_alert(self, d: _Draft, reason: str, notes: list[str]) -> list[Intervention]:
        """``alert`` (or any note): one message naming what was done and why; critical from
        level 3, on a rollback or stop, or on a critical alarm."""
        if "alert" not in d.actions and not notes:
            return []
        sev = "critical" if (max(d.level, 1) >= 3 or d.actions & {"rollback", "stop"}
                             or any(a.severity == "critical"
                                    for v in d.by_kind.values() for a in v)) else "warning"
        done = ", ".join(a for a in ACTIONS if a in d.actions and a != "alert") or "none"
        msg = f"step {d.step}: {reason} -> {done}" + ("; " + "; ".join(notes) if notes else "")
        return [Alert(d.step, reason, severity=sev, message=msg)]

    def _may_keep_position(self, step: int) -> bool:
        """Whether a replayed fault that broke the model state (cause ``corruption``) may be
        answered by restoring the healthy weights without replaying its step: not yet tried
        for this onset (invariant 6) and a rollback left (invariant 5)."""
        onset = self._onset_or(step)
        return (self.cause == "corruption" or self._replayed_cause(step) == "corruption") \
            and not any(abs(onset - o) <= 3 for o in self._kept_onsets) \
            and self.n_rollbacks < self.config.max_rollbacks

    def _restore_keeping_position(self, d: _Draft, reason: str,
                                  target: CheckpointRef) -> list[Intervention]:
        """``rollback`` of a deterministic fault in the model state: restore ``target`` keeping
        the step counter, scheduler and data position (the fault's step is not replayed).
        Counted as a rollback (its steps are lost); the policy's clock does not rewind, the
        recent loss level restarts at the restored weights'."""
        self.n_rollbacks += 1
        self._kept_onsets = [*self._kept_onsets[-7:], self._onset_or(d.step)]
        self._onset = None
        self._rolled_back = True
        self._probation = None
        if not self.log_only:
            d.control.rollback_to = target.step
            d.control.skip_batches = None
            d.control.keep_position = True
            self.loss.rewind()
        return [Rollback(d.step, reason, to_step=target.step, skip_from=d.step,
                         skip_to=d.step - 1, keep_position=True)]

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



