"""Policy: turn alarms into one coherent response per incident, chosen from its *cause*.

Every step (quiet ones too) :meth:`Policy.track` follows the requested LR (the
:class:`~stability.lr_guard.LRGuard` divides an LR fault out for as long as the scheduler asks for
it) and the training loss ("measurably worse" than before the episode).  On alarm steps
:meth:`Policy.step` attributes the episode (:mod:`stability.attribution`: ``lr``, ``outlier``,
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
   gradient norms (``context["grad_norm_recent_median"]``), never above the clip in force;
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
explosion, ...) came first, also a checkpoint + rollback.  ``r`` is ``context["lr"] /
context["lr_prev"]`` when the monitor passes them, else ``exp(score * lr_jump.log_unit)``.

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

from ._state_check import Fields
from .attribution import DATA_CAUSES, attribute
from .loss_tracker import LossTracker, ValTracker
from .lr_guard import LRGuard
from .lr_schedule import adaptive_clip, compound_factor, lr_cut_end, lr_factor_at
from .policy_config import ACTIONS, PolicyConfig
from .types import (
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

STATE_VERSION = 2
_SEV = {s: i for i, s in enumerate(SEVERITIES)}
_INF = 2**62


class Policy:
    """Escalation-ladder policy; see the module docstring for the semantics.

    Parameters
    ----------
    config : dict, PolicyConfig or None
        The ``[policy]`` table (validated by :meth:`PolicyConfig.from_dict`).
    """

    def __init__(self, config: Mapping[str, Any] | PolicyConfig | None = None) -> None:
        self.config = config if isinstance(config, PolicyConfig) else PolicyConfig.from_dict(config)
        self.log_only = self.config.mode == "log_only"
        self._min_sev = _SEV[self.config.min_severity]
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every incident (fresh state)."""
        self._level = 0
        self._last_alarm: int | None = None
        self._last_response: int | None = None
        self._kind_last: dict[str, int] = {}
        self._onset: int | None = None
        self._hist: dict[str, list[int]] = {}
        self._lr: tuple[int, float, int, int] | None = None   # start, factor, duration, restore
        self._clip: tuple[float, int, int] | None = None      # norm, start, duration
        self._neutral_from = -_INF
        self._rewound_to: int | None = None
        self._jump: tuple[float, int, float] | None = None  # held ratio, last alarm, factor
        self._damage_last: int | None = None
        self._rolled_back = False
        # after a rollback for a data cause: (resume step, target, steps measurably worse, cause)
        self._probation: tuple[int, int, int, str] | None = None
        self.n_rollbacks = 0
        self.n_responses = 0
        self.n_merged = 0
        self.guard = LRGuard(self.config.lr_guard)
        self._reset_episode()
        rc = self.config.recovery
        self.loss = LossTracker(rc.fast_alpha, rc.base_alpha)
        self.val = ValTracker(rc.val_margin)

    def _reset_episode(self) -> None:
        """Forget the open episode (after a rollback, or when it is over)."""
        self._consec = 0            # consecutive alarm steps of the episode
        self._last_seen = -_INF     # last step with acting alarms
        self._skip_run = 0          # consecutive skipped steps
        self._adapt_start: int | None = None
        self._adapt_fast = math.nan
        self.cause = ""

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state (``"version"`` key); config is not included."""
        return {
            "version": STATE_VERSION,
            "level": self._level,
            "last_alarm": self._last_alarm,
            "last_response": self._last_response,
            "kind_last": dict(self._kind_last),
            "onset": self._onset,
            "hist": {k: list(v) for k, v in self._hist.items()},
            "lr": None if self._lr is None else list(self._lr),
            "clip": None if self._clip is None else list(self._clip),
            "jump": None if self._jump is None else list(self._jump),
            "damage_last": self._damage_last,
            "n_rollbacks": self.n_rollbacks,
            "n_responses": self.n_responses,
            "n_merged": self.n_merged,
            "guard": self.guard.state_dict(),
            "episode": {"consec": self._consec, "last_seen": self._last_seen,
                        "skip_run": self._skip_run, "adapt_start": self._adapt_start,
                        "adapt_fast": _enc(self._adapt_fast), "cause": self.cause},
            "probation": None if self._probation is None else list(self._probation),
            "loss": self.loss.state_dict(),
            "val": self.val.state_dict(),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; later decisions are identical.

        This policy's configuration wins (it is not part of the snapshot).  Every field is
        checked before anything changes: a malformed one (a NaN or negative LR factor, a
        negative hold, a tuple of the wrong length, ...) raises ``ValueError`` naming it and
        leaves the policy as it was.
        """
        f = Fields("Policy", sd)
        f.version(STATE_VERSION, default=0)
        n_levels = len(self.config.ladder)
        level = min(f.integer("level", f.get("level", 0), lo=0, hi=10_000), n_levels)
        last_alarm = f.opt_integer("last_alarm")
        last_response = f.opt_integer("last_response")
        kind_last = {f.text("kind_last", value=k, max_len=200): f.integer(f"kind_last.{k}", v)
                     for k, v in f.mapping("kind_last", {}).items()}
        onset = f.opt_integer("onset")
        hist = {f.text("hist", value=k, max_len=200): [f.integer(f"hist.{k}", x)
                                                      for x in f.seq(f"hist.{k}", None, v)]
                for k, v in f.mapping("hist", {}).items()}
        lr_ = f.opt_seq("lr", 4)
        lr = None if lr_ is None else (
            f.integer("lr[0]", lr_[0]), f.number("lr[1]", lr_[1], lo=0.0, hi=1.0, low_open=True),
            f.integer("lr[2]", lr_[2], lo=0), f.integer("lr[3]", lr_[3], lo=0))
        clip_ = f.opt_seq("clip", 3)
        clip = None if clip_ is None else (
            f.number("clip[0]", clip_[0], lo=0.0, low_open=True), f.integer("clip[1]", clip_[1]),
            f.integer("clip[2]", clip_[2], lo=0))
        jump_ = f.opt_seq("jump", 3)
        jump = None if jump_ is None else (
            f.number("jump[0]", jump_[0], lo=0.0, low_open=True), f.integer("jump[1]", jump_[1]),
            f.number("jump[2]", jump_[2], lo=0.0, hi=1.0, low_open=True))
        damage_last = f.opt_integer("damage_last")
        counts = {k: f.integer(k, f.get(k, 0), lo=0) for k in ("n_rollbacks", "n_responses",
                                                           "n_merged")}
        ep = f.sub("episode", {})
        consec = ep.integer("consec", ep.get("consec", 0), lo=0)
        last_seen = ep.integer("last_seen", ep.get("last_seen", -_INF))
        skip_run = ep.integer("skip_run", ep.get("skip_run", 0), lo=0)
        adapt_start = ep.opt_integer("adapt_start")
        adapt_fast = ep.number("adapt_fast", ep.get("adapt_fast", math.nan), nan=True)
        cause = ep.text("cause", "", max_len=200)
        pb = f.opt_seq("probation", 4)
        probation = None if pb is None else (
            f.integer("probation[0]", pb[0]), f.integer("probation[1]", pb[1]),
            f.integer("probation[2]", pb[2], lo=0),
            f.text("probation[3]", value=pb[3], max_len=200))
        guard = LRGuard(self.config.lr_guard)
        if f.get("guard", None) is not None:
            guard.load_state_dict(f.get("guard"))
        rc = self.config.recovery
        loss = LossTracker(rc.fast_alpha, rc.base_alpha)
        loss.load_state_dict(f.mapping("loss", {}))
        val = ValTracker(rc.val_margin)
        val.load_state_dict(f.mapping("val", {}))
        # everything checked: now install it
        self.reset()
        self._level, self._last_alarm, self._last_response = level, last_alarm, last_response
        self._kind_last, self._onset, self._hist = kind_last, onset, hist
        self._lr, self._clip, self._jump, self._damage_last = lr, clip, jump, damage_last
        self.n_rollbacks = counts["n_rollbacks"]
        self.n_responses = counts["n_responses"]
        self.n_merged = counts["n_merged"]
        self.guard, self.loss, self.val = guard, loss, val
        self._consec, self._last_seen, self._skip_run = consec, last_seen, skip_run
        self._adapt_start, self._adapt_fast, self.cause = adapt_start, adapt_fast, cause
        self._probation = probation
        self._update_neutral()

    # ------------------------------------------------------------------ pure queries
    def level_at(self, step: int) -> int:
        """Escalation level at ``step`` after hysteresis decay (0 = no incident).

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

        A pure function of (state, step): exactly what :meth:`step` writes on a step without
        alarms.  Neutral in ``log_only`` mode.
        """
        return Control() if self.log_only else self.planned_control_at(step)

    def _apply_persistent(self, step: int, control: Control) -> None:
        if step >= self._neutral_from and not self.guard.active:
            control.lr_factor, control.clip_norm = 1.0, None
        else:
            control.lr_factor = self.lr_factor_at(step)
            control.clip_norm = self.clip_norm_at(step)

    def _update_neutral(self) -> None:
        ends = [-_INF]
        if self._lr is not None:
            ends.append(lr_cut_end(self._lr[0], self._lr[2], self._lr[3]))
        if self._clip is not None:
            ends.append(_INF if self._clip[2] == 0 else self._clip[1] + self._clip[2])
        self._neutral_from = max(ends)

    # ------------------------------------------------------------------ every step
    def track(self, step: int, lr: float | None = None, loss: float | None = None,
              control: Control | None = None, val: float | None = None) -> list[Intervention]:
        """Follow the requested LR and the training loss of every step, quiet ones included.

        Call before :meth:`step` for the same step (the monitor does).  The LR goes to the
        :class:`~stability.lr_guard.LRGuard`: when it leaves its healthy band the LR factor
        divides the fault out for as long as the scheduler keeps asking for it (an ``alert`` and
        a ``reduce_lr`` with ``duration = 0`` mark the start, an ``alert`` the release).  The
        loss feeds the "measurably worse" test that gates rollbacks of data-caused episodes and
        every stop.

        Returns
        -------
        list of Intervention
            Non-empty only when an LR fault starts or ends.
        """
        step = int(step)
        out: list[Intervention] = []
        if val is not None:
            self.val.update(step, val, self.loss.fast)
        if loss is not None:
            self._track_loss(step, loss)
            if self._probation is not None:
                out = self._check_probation(step, control)
        if lr is None or not self.config.lr_guard.enabled:
            return out
        g = self.guard
        was = g.active
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
            out += [Alert(step, reason, cause="lr", severity="warning",
                          message=f"step {step}: {reason}; LR guard released")]
        if control is not None and not self.log_only and (g.active or was):
            self._apply_persistent(step, control)
        return out

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
        if self.val.best_step >= 0:
            out.append(self.val.best_step + 1)
        return out

    def _check_probation(self, step: int, control: Control | None) -> list[Intervention]:
        """After a rollback that skipped bad data: does the data source keep failing?

        If the loss stays measurably worse than before the episode for ``adapt_steps`` steps
        within ``recur_steps`` of the rollback, the source is broken (a stuck loader, bad shards
        to the end): nothing left to try, so stop with the healthy checkpoint restored.
        """
        assert self._probation is not None
        start, target, n_worse, cause = self._probation
        rc = self.config.recovery
        if step - start > rc.recur_steps:
            self._probation = None
            return []
        n_worse = n_worse + 1 if self.worse() else 0
        self._probation = (start, target, n_worse, cause)
        if n_worse < max(1, rc.adapt_steps):
            return []
        self._probation = None
        reason = (f"the loss stayed measurably worse for {n_worse} steps after the rollback at "
                  f"step {start} skipped the bad data: the data source keeps failing")
        return self._stop_restoring(step, target, reason, cause, control)

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

    def _track_loss(self, step: int, loss: float) -> None:
        quiet = (step - self._last_seen > self.config.cooldown and not self.guard.active
                 and self._probation is None)
        self.loss.update(loss, quiet)

    def worse(self) -> bool | None:
        """Is the run measurably worse than before the episode?  ``None``: cannot tell."""
        return self.loss.worse(self.config.recovery.worse_margin)

    def _improving(self) -> bool:
        fast = self.loss.fast
        return (not math.isnan(self._adapt_fast) and not math.isnan(fast)
                and fast < self._adapt_fast - 0.02)

    def _exhausted(self, step: int, ctx: Mapping[str, Any]) -> bool:
        """No rollback left to try: the limit is reached or no healthy checkpoint exists."""
        if self.n_rollbacks >= self.config.max_rollbacks:
            return True
        ledger = ctx.get("healthy_checkpoints")
        onset = step if self._onset is None else self._onset
        return ledger is None or ledger.latest_healthy_before(
            onset, self.config.checkpoint_margin) is None

    def rollback_failed(self, step: int) -> None:
        """The trainer could not carry out the rollback requested at ``step``: not counted."""
        self.n_rollbacks = max(0, self.n_rollbacks - 1)

    # ------------------------------------------------------------------ the decision
    def step(
        self,
        step: int,
        alarms: Sequence[Alarm],
        control: Control,
        context: Mapping[str, Any] | None = None,
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
        context : mapping, optional
            ``grad_norm``, ``grad_norm_recent_median``, ``clip_norm`` (the trainer's own clip),
            ``healthy_checkpoints`` (a :class:`~stability.checkpoints.CheckpointLedger`), ``lr``
            and ``lr_prev`` (the raw scheduler LR of this step and of the previous observed step,
            read on LR-jump alarm steps to size the cut exactly); all optional.  The policy notes
            alarm steps in the ledger, and rewinds it on a rollback when ``rewind_on_rollback``.

        Returns
        -------
        list of Intervention
            Empty on quiet and merged steps.
        """
        step = int(step)
        acts = [a for a in alarms if _SEV.get(a.severity, 1) >= self._min_sev] if alarms else []
        if not acts:
            if not self.log_only:
                self._apply_persistent(step, control)
            return []
        ctx: Mapping[str, Any] = context or {}
        cfg = self.config
        jcfg = cfg.lr_jump
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
        self._consec = self._consec + 1 if 0 < step - self._last_seen <= 3 else 1
        self._last_seen = step
        rc = cfg.recovery
        cause = attribute(acts, lr_fault=self.guard.active,
                          nonfinite_loss_run=self.loss.nonfinite_run,
                          consecutive=self._consec, persistent_after=rc.max_consecutive_skips)
        val = self.val
        if ("train_val_divergence" in {a.kind for a in acts}
                and val.worse_points >= rc.val_patience and cause == "divergence"
                and self.loss.fast < val.train_at_best + math.log1p(-rc.val_train_drop)):
            # overfitting: validation keeps getting worse while training does not -- early stop
            # with the checkpoint of the best validation point restored
            ledger = ctx.get("healthy_checkpoints")
            rec = None if ledger is None else ledger.latest_healthy_before(
                val.best_step + 1, cfg.checkpoint_margin)
            reason = (f"validation loss {val.worse_points} points above its best "
                      f"({val.best:.4g} at step {val.best_step}) by more than "
                      f"{rc.val_margin:.0%} while the training loss fell "
                      f"{1 - math.exp(self.loss.fast - val.train_at_best):.0%} below its level "
                      f"then: overfitting")
            return self._stop_restoring(step, None if rec is None else rec.step, reason,
                                        "overfit", control)
        self.cause = cause
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
            ledger = ctx.get("healthy_checkpoints")
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
        if skip and cause == "shift" and not nonfinite_now:
            skip = False  # no skip storms: a persistent shift must be learned, not skipped
        adapting = cause == "shift" or (
            cause == "overflow" and self._consec > rc.max_consecutive_skips)
        if adapting and self._adapt_start is None:
            self._adapt_start = step
            self._adapt_fast = self.loss.fast
            actions.update(("alert", "clip", "reduce_lr"))
            responded = True
        if cause == "corruption":
            actions.update(("alert", "checkpoint", "rollback"))
            skip = True
            responded = True
        worse = self.worse()
        if "stop" in actions and not self._exhausted(step, ctx):
            # stop only when nothing is left to try: a rollback comes first
            actions = (actions - {"stop"}) | {"checkpoint", "rollback"}
        if "rollback" in actions and cause in ("shift", "overflow", "outlier", "divergence"):
            ok = worse is not False and (cause in ("outlier", "divergence") or (
                self._adapt_start is not None and step - self._adapt_start >= rc.adapt_steps
                and not self._improving()))
            if not ok:
                actions -= {"rollback", "checkpoint"}
                if self._adapt_start is None:
                    self._adapt_start = step
                    self._adapt_fast = self.loss.fast
                    actions.update(("alert", "clip", "reduce_lr"))
        if skip:
            actions.add("skip")
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
            self._reset_episode()
            self.guard.rewind()
            self.val.rewind(self._rewound_to if self._rewound_to is not None else step)
        self._update_neutral()
        if not self.log_only:
            # after a rewinding rollback the trainer continues from the restored step
            self._apply_persistent(step if self._rewound_to is None else self._rewound_to,
                                   control)
        return ivs

    # ------------------------------------------------------------------ building the response
    def _build(self, step: int, actions: set[str], by_kind: Mapping[str, list[Alarm]],
               level: int, ctx: Mapping[str, Any], control: Control,
               jump: float | None = None) -> list[Intervention]:
        cfg = self.config
        act = not self.log_only
        reason = f"L{level}: " + "; ".join(
            f"{k}({_signals(v)})" for k, v in sorted(by_kind.items()))
        notes: list[str] = []
        out: list[Intervention] = []
        self._rolled_back = False
        if "rollback" in actions and self.n_rollbacks >= cfg.max_rollbacks:
            actions = (actions - {"rollback"}) | {"stop"}
            notes.append(f"rollback limit ({cfg.max_rollbacks}) reached")
        if "rollback" in actions:
            onset = step if self._onset is None else self._onset
            ledger = ctx.get("healthy_checkpoints")
            if ledger is None or ledger.latest_healthy_before(onset, cfg.checkpoint_margin) is None:
                actions = actions - {"rollback"}
                notes.append(f"no healthy checkpoint before onset {onset}: cannot roll back")
                if self.cause == "corruption":  # a broken state with nothing to restore
                    actions = actions | {"stop"}
        if "stop" in actions:
            worse = self.worse()
            if worse is False:
                actions = actions - {"stop"}
                notes.append("would stop, but the run is not measurably worse than before the "
                             "episode: continuing")
            else:
                tried = f"{self.n_rollbacks} rollback(s)"
                if self._adapt_start is not None:
                    tried += f", adapting since step {self._adapt_start}"
                notes.append(f"cause: {self.cause or 'unknown'}; tried: {tried}")
        if "skip" in actions:
            out.append(SkipStep(step, reason))
            if act:
                control.skip_step = True
        if "clip" in actions:
            current = self.clip_norm_at(step)
            if current is None:
                current = _finite_or_none(ctx.get("clip_norm"))
            med = _finite_or_none(ctx.get("grad_norm_recent_median"))
            norm = adaptive_clip(med, cfg.clip.factor, current, tighten=cfg.clip.tighten,
                                 min_norm=cfg.clip.min_norm, max_norm=cfg.clip.max_norm)
            if norm is None:
                notes.append("no gradient statistics to derive a clip from")
            else:
                self._clip = (norm, step, cfg.clip.duration)
                out.append(SetClip(step, reason, max_norm=norm, duration=cfg.clip.duration))
        if "reduce_lr" in actions and jump is not None:
            j = cfg.lr_jump
            cur = self.lr_factor_at(step)
            held = self._jump_active(step)
            total = jump * (held[0] if held is not None else 1.0)
            f = max(cfg.lr.min_factor, min(1.0, cur) * min(1.0 / jump, cfg.lr.factor))
            self._jump = (total, step, f)
            self._lr = (step, f, j.hold, j.restore_steps)
            out.append(ReduceLR(step, reason, factor=f, duration=j.hold,
                                restore_steps=j.restore_steps))
            notes.append(f"LR jumped x{jump:.3g}: LR factor {f:.3g}, held until {j.hold} steps "
                         f"after the last jump alarm")
        elif "reduce_lr" in actions:
            f = compound_factor(self._ladder_lr_factor_at(step), cfg.lr.factor,
                                cfg.lr.min_factor)
            self._lr = (step, f, cfg.lr.duration, cfg.lr.restore_steps)
            out.append(ReduceLR(step, reason, factor=f, duration=cfg.lr.duration,
                                restore_steps=cfg.lr.restore_steps))
        if "checkpoint" in actions:
            out.append(Checkpoint(step, reason, healthy=False))
            if act:
                control.save_checkpoint = True
                control.checkpoint_reason = reason
        if "rollback" in actions:
            onset = step if self._onset is None else self._onset
            ledger = ctx.get("healthy_checkpoints")
            target = None if ledger is None else ledger.latest_healthy_before(
                onset, cfg.checkpoint_margin)
            skip_data = self.cause in DATA_CAUSES or not self.cause
            if target is None:
                notes.append(f"no healthy checkpoint before onset {onset}: cannot roll back")
            else:
                out.append(Rollback(step, reason, to_step=target.step, skip_from=onset,
                                    skip_to=step if skip_data else onset - 1))
                self.n_rollbacks += 1
                self._onset = None
                self._rolled_back = True  # log_only decides as if it had acted
                resume = target.covers if act and cfg.rewind_on_rollback else step
                self._probation = ((resume, target.step, 0, self.cause)
                                   if skip_data and self.cause else None)
                if act:
                    control.rollback_to = target.step
                    control.skip_batches = (onset, step) if skip_data else None
                    if cfg.rewind_on_rollback:
                        self._rewind(step, target.covers, ledger)
                        self._rewound_to = target.covers
        if "stop" in actions:
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

    # ------------------------------------------------------------------ LR jumps
    def _is_jump(self, a: Alarm) -> bool:
        j = self.config.lr_jump
        return a.detector in j.detectors and _SEV.get(a.severity, 1) >= _SEV[j.min_severity]

    def _jump_ratio(self, alarms: Sequence[Alarm], ctx: Mapping[str, Any]) -> float | None:
        """Ratio of the LR jump behind this step's LR-jump alarms (``None``: no such alarm).

        ``context["lr"] / context["lr_prev"]`` when both are known, else the lower bound
        ``exp(score * log_unit)`` from the largest alarm score.
        """
        scores = [a.score for a in alarms if self._is_jump(a)]
        if not scores:
            return None
        lr, prev = _finite_or_none(ctx.get("lr")), _finite_or_none(ctx.get("lr_prev"))
        if lr is not None and prev is not None and lr > 0.0 and prev > 0.0 and lr > prev:
            return lr / prev
        x = max(scores) * self.config.lr_jump.log_unit
        return math.exp(min(x, 700.0)) if not math.isnan(x) else math.inf

    def _jump_active(self, step: int) -> tuple[float, int, float] | None:
        """The jump hold in force at ``step`` (still held or ramping back), else ``None``."""
        j = self.config.lr_jump
        if self._jump is None or not 0 <= step - self._jump[1] < j.hold + j.restore_steps:
            return None
        return self._jump

    def _rearm(self, step: int, ratio: float) -> bool:
        """Extend the hold when ``ratio`` is the jump already held (e.g. a frozen detector)."""
        held = self._jump_active(step)
        j = self.config.lr_jump
        if held is None or ratio > j.rearm_tolerance * held[0]:
            return False
        f = min(held[2], self.lr_factor_at(step))
        self._jump = (held[0], step, held[2])
        self._lr = (step, f, j.hold, j.restore_steps)
        return True

    def _rewind(self, step: int, to: int, ledger: Any) -> None:
        """The trainer restarts counting at ``to + 1``: shift every timestamp by ``to - step``."""
        d = to - step

        def sh(x: int | None) -> int | None:
            return None if x is None else x + d

        self._last_alarm = sh(self._last_alarm)
        self._last_response = sh(self._last_response)
        self._kind_last = {k: v + d for k, v in self._kind_last.items()}
        self._hist = {k: [x + d for x in v] for k, v in self._hist.items()}
        if self._lr is not None:
            self._lr = (self._lr[0] + d,) + self._lr[1:]
        if self._clip is not None:
            self._clip = (self._clip[0], self._clip[1] + d, self._clip[2])
        if self._jump is not None:
            self._jump = (self._jump[0], self._jump[1] + d, self._jump[2])
        self._damage_last = sh(self._damage_last)
        if ledger is not None and hasattr(ledger, "rewind"):
            ledger.rewind(to)

    def __repr__(self) -> str:
        return f"Policy(mode={self.config.mode!r}, level={self._level})"


def _signals(alarms: Iterable[Alarm], limit: int = 3) -> str:
    sig = sorted({a.signal for a in alarms})
    more = f", +{len(sig) - limit}" if len(sig) > limit else ""
    return ", ".join(sig[:limit]) + more


def _finite_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _enc(v: float) -> float | str:
    """JSON-safe float (non-finite as a string, read back by ``float``)."""
    return v if math.isfinite(v) else str(v)
