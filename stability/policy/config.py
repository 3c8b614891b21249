"""The ``[policy]`` table: schema, defaults and validation with errors that name the key.

Unknown keys are rejected (a typo must not silently fall back to a default).  Per-kind rules are
merged field by field over the built-in defaults, so ``kinds.nonfinite.patience = 5`` keeps the
other ``nonfinite`` settings.

Examples
--------
>>> cfg = PolicyConfig.from_dict({"cooldown": 10, "lr": {"factor": 0.3}})
>>> cfg.cooldown, cfg.lr.factor, cfg.lr.duration
(10, 0.3, 100)
>>> PolicyConfig.from_dict({"cooldwn": 10})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
stability.config.registry.ConfigError: policy: unknown key 'cooldwn' (did you mean 'cooldown'?); ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stability.config.registry import ConfigError
from stability.config.sections import _bool, _choice, _int, _known, _number
from stability.policy.lr_guard import LRGuardConfig
from stability.policy.lr_schedule import RAMP_SHAPES
from stability.types import ALARM_KINDS, SEVERITIES

#: Action names usable in a ladder level.
ACTIONS = ("alert", "clip", "skip", "reduce_lr", "checkpoint", "rollback", "stop")
MODES = ("act", "log_only")
SKIP_RULES = ("always", "critical", "never")

Ladder = tuple[tuple[str, ...], ...]

DEFAULT_LADDER: Ladder = (
    ("alert", "clip"),
    ("alert", "reduce_lr"),
    ("alert", "checkpoint", "rollback"),
    ("alert", "stop"),
)


# ------------------------------------------------------------------------------- validators
def _fields(cls: Any) -> tuple[str, ...]:
    """The keys of a section: its dataclass fields, sorted (as error messages list them)."""
    return tuple(sorted(f.name for f in dataclasses.fields(cls)))


def _names(v: Any, path: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not all(
            isinstance(x, str) for x in v):
        raise ConfigError(f"{path}: must be a list of names; got {v!r}.")
    if allowed is not None:
        for x in v:
            if x not in allowed:
                raise ConfigError(f"{path}: unknown name {x!r}; allowed: {', '.join(allowed)}.")
    return tuple(v)


def _ladder(v: Any, path: str) -> Ladder:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v:
        raise ConfigError(f"{path}: must be a non-empty list of levels (lists of actions); "
                          f"got {v!r}.")
    out = []
    for i, level in enumerate(v):
        if isinstance(level, str) or not isinstance(level, (list, tuple)):
            raise ConfigError(f"{path}[{i}]: must be a list of actions; got {level!r}.")
        for a in level:
            if a not in ACTIONS:
                raise ConfigError(f"{path}[{i}]: unknown action {a!r}; "
                                  f"allowed: {', '.join(ACTIONS)}.")
        out.append(tuple(str(a) for a in level))
    return tuple(out)


# ------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ClipConfig:
    """``[policy.clip]``: how a tighter gradient clip is derived (see ``adaptive_clip``)."""

    factor: float = 2.0      #: max_norm = factor * grad_norm_recent_median
    tighten: float = 0.5     #: without a median: current clip * tighten
    min_norm: float = 1e-6   #: floor
    max_norm: float | None = None  #: cap (e.g. the trainer's own clip); None = no cap
    duration: int = 200      #: steps the tighter clip holds; 0 = until changed

    @classmethod
    def from_dict(cls, d: Any, path: str = "policy.clip") -> ClipConfig:
        d = _known(d, _fields(cls), path)
        c = cls()
        mx = d.get("max_norm", c.max_norm)
        return cls(
            factor=_number(d.get("factor", c.factor), f"{path}.factor", 0.0, low_open=True,
                           high=1e12),
            tighten=_number(d.get("tighten", c.tighten), f"{path}.tighten", 0.0, low_open=True,
                            high=1.0),
            min_norm=_number(d.get("min_norm", c.min_norm), f"{path}.min_norm", 0.0, high=1e12),
            max_norm=None if mx is None else _number(mx, f"{path}.max_norm", 0.0, low_open=True,
                                                     high=1e12),
            duration=_int(d.get("duration", c.duration), f"{path}.duration", 0),
        )


@dataclass(frozen=True)
class LRConfig:
    """``[policy.lr]``: the temporary LR cut and its gradual restore."""

    factor: float = 0.5       #: multiplier of a cut (compounds if a cut is already active)
    duration: int = 100       #: steps at the reduced LR
    restore_steps: int = 50   #: steps of the ramp back to 1.0
    shape: str = "linear"     #: ramp shape: linear | cosine | step
    min_factor: float = 0.01  #: compounding floor

    @classmethod
    def from_dict(cls, d: Any, path: str = "policy.lr") -> LRConfig:
        d = _known(d, _fields(cls), path)
        c = cls()
        out = cls(
            factor=_number(d.get("factor", c.factor), f"{path}.factor", 0.0, low_open=True,
                           high=1.0),
            duration=_int(d.get("duration", c.duration), f"{path}.duration", 0),
            restore_steps=_int(d.get("restore_steps", c.restore_steps), f"{path}.restore_steps", 0),
            shape=_choice(d.get("shape", c.shape), f"{path}.shape", RAMP_SHAPES),
            min_factor=_number(d.get("min_factor", c.min_factor), f"{path}.min_factor", 0.0,
                               low_open=True, high=1.0),
        )
        if out.min_factor > out.factor:
            raise ConfigError(f"{path}.min_factor: must be <= {path}.factor ({out.factor}); "
                              f"got {out.min_factor}.")
        return out


@dataclass(frozen=True)
class LRJumpConfig:
    """``[policy.lr_jump]``: a response sized to an abrupt jump of the scheduler's LR.

    An alarm of one of ``detectors`` (binding names of ``lr_jump`` detectors) at ``min_severity``
    or above means the raw LR just jumped by a ratio ``r``: ``context["lr"] / context["lr_prev"]``
    when the monitor passes both, else the lower bound ``exp(score * log_unit)`` (``LRJump``'s
    score is ``dlog(lr) / max(typical, min_delta)``; ``log_unit`` = the detector's ``min_delta``).
    The policy then multiplies the LR factor in force by ``min(1 / r, lr.factor)`` (floored at
    ``lr.min_factor``), holds it until ``hold`` steps after the latest such alarm (each further
    alarm of the same jump re-arms the hold without compounding), then ramps back to 1.0 over
    ``restore_steps`` steps.  When one of ``damage_kinds`` alarmed within ``damage_window`` steps
    (the jump already hurt the model), it also checkpoints and rolls back (``rollback_on_damage``).
    """

    enabled: bool = True
    detectors: tuple[str, ...] = ("lr_jump",)  #: binding names of the LR-jump detectors
    min_severity: str = "critical"  #: weaker jump alarms get the ordinary ladder response
    log_unit: float = 0.01          #: ratio = exp(score * log_unit) without context["lr"]
    hold: int = 50                  #: steps held after the latest jump alarm
    restore_steps: int = 20         #: ramp back to 1.0 after the hold
    rearm_tolerance: float = 1.5    #: a jump <= tolerance * the held ratio re-arms, not compounds
    rollback_on_damage: bool = True
    damage_kinds: tuple[str, ...] = ("nonfinite", "loss_spike", "grad_explosion",
                                     "activation_shift")
    damage_window: int = 20         #: damage alarms this recent (steps) count

    @classmethod
    def from_dict(cls, d: Any, path: str = "policy.lr_jump") -> LRJumpConfig:
        d = _known(d, _fields(cls), path)
        c = cls()
        return cls(
            enabled=_bool(d.get("enabled", c.enabled), f"{path}.enabled"),
            detectors=_names(d.get("detectors", c.detectors), f"{path}.detectors"),
            min_severity=_choice(d.get("min_severity", c.min_severity), f"{path}.min_severity",
                                 SEVERITIES),
            log_unit=_number(d.get("log_unit", c.log_unit), f"{path}.log_unit", 0.0, low_open=True,
                             high=1e3),
            hold=_int(d.get("hold", c.hold), f"{path}.hold", 1),
            restore_steps=_int(d.get("restore_steps", c.restore_steps), f"{path}.restore_steps", 0),
            rearm_tolerance=_number(d.get("rearm_tolerance", c.rearm_tolerance),
                                    f"{path}.rearm_tolerance", 1.0, high=1e12),
            rollback_on_damage=_bool(d.get("rollback_on_damage", c.rollback_on_damage),
                                     f"{path}.rollback_on_damage"),
            damage_kinds=_names(d.get("damage_kinds", c.damage_kinds), f"{path}.damage_kinds",
                                ALARM_KINDS),
            damage_window=_int(d.get("damage_window", c.damage_window), f"{path}.damage_window", 0),
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["detectors"] = list(self.detectors)
        d["damage_kinds"] = list(self.damage_kinds)
        return d


@dataclass(frozen=True)
class KindRule:
    """``[policy.kinds.<kind>]``: how one alarm kind maps onto the ladder.

    ``ladder`` (``None`` = the global ladder) gives the actions per level; a kind whose ladder is
    shorter stays at its last level.  ``escalate = false`` kinds neither raise nor are merged by
    the shared escalation level (they have their own cooldown).  ``skip`` says when the optimizer
    step is skipped (on every matching alarm step, also inside a cooldown).  ``patience > 0``:
    that many alarm steps of this kind within ``escalation_window`` jump to at least
    ``persist_level``, even inside a cooldown.
    """

    ladder: Ladder | None = None
    escalate: bool = True
    skip: str = "critical"
    start_level: int = 1
    critical_start_level: int = 1
    patience: int = 0
    persist_level: int = 3

    @classmethod
    def from_dict(cls, d: Any, path: str, base: KindRule | None = None) -> KindRule:
        d = _known(d, _fields(cls), path)
        c = base or cls()
        lad = d.get("ladder", c.ladder)
        return cls(
            ladder=None if lad is None else _ladder(lad, f"{path}.ladder"),
            escalate=_bool(d.get("escalate", c.escalate), f"{path}.escalate"),
            skip=_choice(d.get("skip", c.skip), f"{path}.skip", SKIP_RULES),
            start_level=_int(d.get("start_level", c.start_level), f"{path}.start_level", 1),
            critical_start_level=_int(d.get("critical_start_level", c.critical_start_level),
                                      f"{path}.critical_start_level", 1),
            patience=_int(d.get("patience", c.patience), f"{path}.patience", 0),
            persist_level=_int(d.get("persist_level", c.persist_level), f"{path}.persist_level", 1),
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ladder"] = None if self.ladder is None else [list(x) for x in self.ladder]
        return d


DEFAULT_KINDS: dict[str, KindRule] = {
    "nonfinite": KindRule(skip="always", patience=3, persist_level=3),
    # a warning alone does not act (invariant 1): no emergency checkpoint either -- it would
    # never be a rollback target (unhealthy), and the overfitting early stop restores the
    # periodic checkpoint of the best validation point
    "train_val_divergence": KindRule(ladder=(("alert",),), escalate=False, skip="never"),
    "lr_loss_anomaly": KindRule(ladder=(("alert", "reduce_lr"),), skip="never"),
    "level_shift": KindRule(ladder=(("alert",),), escalate=False, skip="never"),
    "weight_corruption": KindRule(skip="always", start_level=3, critical_start_level=3),
    # the stall watchdog: tell a human, never act (a hung step cannot be skipped or rolled back)
    "stall": KindRule(ladder=(("alert",),), escalate=False, skip="never"),
    # a rank outlier: ControlSync already makes every rank skip a NaN / gradient-outlier step;
    # the policy only alerts (the machine-health ledger accumulates the evidence)
    "rank_outlier": KindRule(ladder=(("alert",),), escalate=False, skip="never"),
    # gradients collapsed (fp16 underflow, dead layers): skipping, clipping or an LR cut would
    # not help and a rollback would replay the same collapse -- tell a human
    "grad_vanishing": KindRule(ladder=(("alert",),), escalate=False, skip="never"),
}


@dataclass(frozen=True)
class RecoveryConfig:
    """``[policy.recovery]``: when a response has demonstrably failed.

    * ``max_consecutive_skips`` -- after this many consecutive skipped steps on *finite* alarms
      (a persistent data / input shift, not a bad batch), the policy stops skipping and
      *adapts* instead: a tighter clip and a temporary LR cut, so the model can learn the new
      distribution (non-finite losses or gradients are always skipped: they cannot be applied);
    * ``adapt_steps`` -- a data-caused episode escalates to a rollback only after this many
      steps of adapting without improvement while the loss is measurably worse;
    * ``worse_margin`` -- "measurably worse": the recent loss (EW mean of log loss, memory
      ~``1/fast_alpha`` steps) above the pre-episode baseline (EW mean, ``1/base_alpha``) by
      more than this relative margin.  A run is stopped only when the ladder is exhausted *and*
      it is measurably worse (or its loss is not finite);
    * ``recur_steps`` -- a data-caused episode that turns persistent again within this many
      steps after a rollback for the same cause is a data source that keeps failing (a broken
      pipeline, a loader stuck on bad shards): the ladder is exhausted for it, so the run is
      stopped -- with the weights of the healthy checkpoint restored -- when it is measurably
      worse;
    * ``val_margin``, ``val_patience``, ``val_train_drop`` -- overfitting: a train/validation
      divergence alarm while the last ``val_patience`` validation points all lie more than
      ``val_margin`` (relative) above the best one *and* the training loss has fallen more than
      ``val_train_drop`` (relative) below its level at the best point (a widening gap from both
      sides -- a persistent input shift moves validation, not this) is early-stopped with the
      checkpoint of the best point restored;
    * ``max_skips`` -- a *skip storm*: this many consecutive skipped steps (non-finite
      gradients on every step, ...) mean the run is not training at all.  It escalates: a
      rollback with an LR cut while rollbacks are left, then a stop with the healthy weights
      restored (whatever the loss says: a run that does not train is not on its trajectory);
    * ``improve_margin`` -- "closing the gap": the recent loss level (log units) fell by more
      than this since the watch began (or since the last such fall).  A run closing the gap is
      returning to its trajectory: it is neither stopped nor rolled back;
    * ``max_undo`` -- damage that outlives its cause: when an episode is over (no acting alarm
      for ``cooldown`` steps, the LR back in its band) and the loss stays measurably worse than
      before it for ``adapt_steps`` steps without closing the gap, the policy rolls back once to
      the latest healthy checkpoint before the onset (skipping the episode's batches when its
      cause was the data).  At most this many such rollbacks per run (0: never).
    """

    max_consecutive_skips: int = 8
    adapt_steps: int = 50
    worse_margin: float = 0.1
    recur_steps: int = 200
    val_margin: float = 0.1
    val_patience: int = 3
    val_train_drop: float = 0.25
    fast_alpha: float = 0.1
    base_alpha: float = 0.02
    max_skips: int = 25
    improve_margin: float = 0.02
    max_undo: int = 1

    @classmethod
    def from_dict(cls, d: Any, path: str = "policy.recovery") -> RecoveryConfig:
        d = _known(d, _fields(cls), path)
        c = cls()
        return cls(
            max_consecutive_skips=_int(d.get("max_consecutive_skips", c.max_consecutive_skips),
                                       f"{path}.max_consecutive_skips", 1),
            adapt_steps=_int(d.get("adapt_steps", c.adapt_steps), f"{path}.adapt_steps", 0),
            recur_steps=_int(d.get("recur_steps", c.recur_steps), f"{path}.recur_steps", 0),
            val_margin=_number(d.get("val_margin", c.val_margin), f"{path}.val_margin", 0.0,
                               high=1e6),
            val_patience=_int(d.get("val_patience", c.val_patience), f"{path}.val_patience", 1),
            val_train_drop=_number(d.get("val_train_drop", c.val_train_drop),
                                   f"{path}.val_train_drop", 0.0, high=0.999),
            worse_margin=_number(d.get("worse_margin", c.worse_margin), f"{path}.worse_margin", 0.0,
                                 high=1e6),
            fast_alpha=_number(d.get("fast_alpha", c.fast_alpha), f"{path}.fast_alpha", 0.0,
                               low_open=True, high=1.0),
            base_alpha=_number(d.get("base_alpha", c.base_alpha), f"{path}.base_alpha", 0.0,
                               low_open=True, high=1.0),
            max_skips=_int(d.get("max_skips", c.max_skips), f"{path}.max_skips", 1),
            improve_margin=_number(d.get("improve_margin", c.improve_margin),
                                   f"{path}.improve_margin", 0.0, high=1e6),
            max_undo=_int(d.get("max_undo", c.max_undo), f"{path}.max_undo", 0),
        )


@dataclass(frozen=True)
class PolicyConfig:
    """The whole ``[policy]`` table.  See the module docstring and ``Policy`` for semantics."""

    mode: str = "act"
    min_severity: str = "warning"
    cooldown: int = 20
    escalation_window: int = 200
    quiet_steps: int = 500
    ladder: Ladder = DEFAULT_LADDER
    rewind_on_rollback: bool = True
    checkpoint_margin: int | None = None
    max_rollbacks: int = 3
    clip: ClipConfig = field(default_factory=ClipConfig)
    lr: LRConfig = field(default_factory=LRConfig)
    lr_jump: LRJumpConfig = field(default_factory=LRJumpConfig)
    lr_guard: LRGuardConfig = field(default_factory=LRGuardConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    kinds: Mapping[str, KindRule] = field(default_factory=lambda: dict(DEFAULT_KINDS))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None = None) -> PolicyConfig:
        """Validate a ``[policy]`` table; missing keys take their defaults."""
        d = _known(d if d is not None else {}, _fields(cls), "policy")
        c = cls()
        kinds = dict(DEFAULT_KINDS)
        kd = _known(d.get("kinds", {}), tuple(sorted(ALARM_KINDS)), "policy.kinds")
        for k, v in kd.items():
            kinds[k] = KindRule.from_dict(v, f"policy.kinds.{k}", kinds.get(k))
        margin = d.get("checkpoint_margin", c.checkpoint_margin)
        out = cls(
            mode=_choice(d.get("mode", c.mode), "policy.mode", MODES),
            min_severity=_choice(d.get("min_severity", c.min_severity), "policy.min_severity",
                                 SEVERITIES),
            cooldown=_int(d.get("cooldown", c.cooldown), "policy.cooldown", 0),
            escalation_window=_int(d.get("escalation_window", c.escalation_window),
                                   "policy.escalation_window", 0),
            quiet_steps=_int(d.get("quiet_steps", c.quiet_steps), "policy.quiet_steps", 1),
            ladder=_ladder(d.get("ladder", c.ladder), "policy.ladder"),
            rewind_on_rollback=_bool(d.get("rewind_on_rollback", c.rewind_on_rollback),
                                     "policy.rewind_on_rollback"),
            checkpoint_margin=None if margin is None else _int(margin, "policy.checkpoint_margin",
                                                               0),
            max_rollbacks=_int(d.get("max_rollbacks", c.max_rollbacks), "policy.max_rollbacks", 0),
            clip=ClipConfig.from_dict(d.get("clip", {})),
            lr=LRConfig.from_dict(d.get("lr", {})),
            lr_jump=LRJumpConfig.from_dict(d.get("lr_jump", {})),
            lr_guard=LRGuardConfig.from_dict(d.get("lr_guard", {})),
            recovery=RecoveryConfig.from_dict(d.get("recovery", {})),
            kinds=kinds,
        )
        for name, given in kd.items():  # levels beyond the ladder are clamped; flag explicit ones
            rule = kinds[name]
            for key in ("start_level", "critical_start_level", "persist_level"):
                if key in given and getattr(rule, key) > len(out.ladder):
                    raise ConfigError(f"policy.kinds.{name}.{key}: exceeds the number of ladder "
                                      f"levels ({len(out.ladder)}); got {getattr(rule, key)}.")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible table that ``from_dict`` accepts back."""
        return {
            "mode": self.mode,
            "min_severity": self.min_severity,
            "cooldown": self.cooldown,
            "escalation_window": self.escalation_window,
            "quiet_steps": self.quiet_steps,
            "ladder": [list(x) for x in self.ladder],
            "rewind_on_rollback": self.rewind_on_rollback,
            "checkpoint_margin": self.checkpoint_margin,
            "max_rollbacks": self.max_rollbacks,
            "clip": dataclasses.asdict(self.clip),
            "lr": dataclasses.asdict(self.lr),
            "lr_jump": self.lr_jump.to_dict(),
            "lr_guard": dataclasses.asdict(self.lr_guard),
            "recovery": dataclasses.asdict(self.recovery),
            "kinds": {k: v.to_dict() for k, v in sorted(self.kinds.items())},
        }

    def rule(self, kind: str) -> KindRule:
        """The rule for ``kind`` (the default rule for kinds without one)."""
        return self.kinds.get(kind, _DEFAULT_RULE)


_DEFAULT_RULE = KindRule()
