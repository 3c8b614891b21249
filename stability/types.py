"""Plain data types shared by the monitor, the policy, the adapters and replay.

All of them are frozen dataclasses (or a small mutable :class:`Control`) that round-trip through
``to_dict()`` / ``from_dict()`` as JSON-compatible data -- no pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: Alarm kinds the monitor emits.
ALARM_KINDS = (
    "nonfinite",
    "loss_spike",
    "grad_explosion",
    "activation_shift",
    "train_val_divergence",
    "lr_loss_anomaly",
    "level_shift",
    "weight_corruption",
    "stall",
    "rank_outlier",
    "grad_vanishing",
)

#: Severity levels, in increasing order.
SEVERITIES = ("info", "warning", "critical")


def _clean_float(v: float) -> float | str:
    """JSON has no NaN/inf: encode them as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _parse_float(v: Any) -> float:
    return float(v)


@dataclass(frozen=True)
class Alarm:
    """One detector crossing its threshold on one signal at one step.

    ``recovering``: the alarm belongs to an excursion already returning to trend (its score
    has given back at least half of the episode's peak excess over the threshold; see
    :mod:`stability.monitor.recovery`): report it, never escalate on it.

    Examples
    --------
    >>> a = Alarm(10, "loss_spike", "loss", 8.2, 6.0, "warning", "ewma_z", "loss 8.2 sigma")
    >>> Alarm.from_dict(a.to_dict()) == a
    True
    """

    step: int
    kind: str
    signal: str
    score: float
    threshold: float
    severity: str
    detector: str
    message: str = ""
    recovering: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["score"] = _clean_float(self.score)
        d["threshold"] = _clean_float(self.threshold)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alarm:
        return cls(
            step=int(d["step"]),
            kind=str(d["kind"]),
            signal=str(d["signal"]),
            score=_parse_float(d["score"]),
            threshold=_parse_float(d["threshold"]),
            severity=str(d["severity"]),
            detector=str(d["detector"]),
            message=str(d.get("message", "")),
            recovering=bool(d.get("recovering", False)),
        )


# ---------------------------------------------------------------------------- interventions
@dataclass(frozen=True)
class Intervention:
    """Base class of typed, serialisable intervention requests.

    ``step`` is the step at which the request was made; ``reason`` says why (usually the alarm
    kinds that triggered it); ``cause`` is the attributed cause of the episode (``"lr"``,
    ``"outlier"``, ``"shift"``, ``"corruption"``, ``"overflow"``, ``"divergence"``; empty when
    unknown).
    """

    step: int
    reason: str = ""
    #: attributed cause of the episode (see ``stability.policy.attribution.CAUSES``)
    cause: str = ""
    type: ClassVar[str] = "intervention"

    def to_dict(self) -> dict[str, Any]:
        d = {
            k: _clean_float(v) if isinstance(v, float) else v
            for k, v in dataclasses.asdict(self).items()
        }
        d["type"] = self.type
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Intervention:
        d = dict(d)
        kind = d.pop("type")
        cls = INTERVENTION_TYPES.get(kind)
        if cls is None:
            raise ValueError(
                f"Unknown intervention type {kind!r}; known: {sorted(INTERVENTION_TYPES)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.type in ("float", float):
                kwargs[f.name] = float(kwargs[f.name])
            if f.name in kwargs and isinstance(kwargs[f.name], list):
                kwargs[f.name] = tuple(kwargs[f.name])
        return cls(**kwargs)


@dataclass(frozen=True)
class ReduceLR(Intervention):
    """Multiply the LR by ``factor`` for ``duration`` steps, then restore over ``restore_steps``."""

    factor: float = 0.5
    duration: int = 100
    restore_steps: int = 50
    type: ClassVar[str] = "reduce_lr"


@dataclass(frozen=True)
class SetClip(Intervention):
    """Clip the global gradient norm at ``max_norm`` for ``duration`` steps (0 = until changed)."""

    max_norm: float = 1.0
    duration: int = 200
    type: ClassVar[str] = "set_clip"


@dataclass(frozen=True)
class SkipStep(Intervention):
    """Do not apply the optimizer step for this batch."""

    type: ClassVar[str] = "skip_step"


@dataclass(frozen=True)
class Checkpoint(Intervention):
    """Take an emergency checkpoint, tagged with the health status at the time."""

    healthy: bool = False
    type: ClassVar[str] = "checkpoint"


@dataclass(frozen=True)
class Rollback(Intervention):
    """Restore the checkpoint taken at ``to_step`` and skip batches ``skip_from..skip_to``.

    ``keep_position``: restore the weights and optimizer state only; the step counter, the
    scheduler and the data position go on, so the faulty step is not replayed (a fault that
    recurred at the same step after a rollback: deterministic).
    """

    to_step: int = 0
    skip_from: int = 0
    skip_to: int = 0
    keep_position: bool = False
    type: ClassVar[str] = "rollback"

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if not self.keep_position:  # (records of ordinary rollbacks are as before)
            d.pop("keep_position")
        return d


@dataclass(frozen=True)
class Stop(Intervention):
    """Stop training cleanly."""

    type: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Alert(Intervention):
    """Notify humans through the configured alert sinks."""

    severity: str = "warning"
    message: str = ""
    type: ClassVar[str] = "alert"


INTERVENTION_TYPES: dict[str, type[Intervention]] = {
    c.type: c for c in (ReduceLR, SetClip, SkipStep, Checkpoint, Rollback, Stop, Alert)
}


# ---------------------------------------------------------------------------- control
@dataclass
class Control:
    """What the monitor asks the trainer to do; the trainer (or an adapter) acts on it.

    Persistent fields hold until the monitor changes them:

    * ``lr_factor`` -- multiply the scheduler's LR by this (1.0 = untouched);
    * ``clip_norm`` -- clip the global gradient norm at this value (``None`` = trainer default).

    Per-step fields are reset by the monitor at the start of every ``observe()``:

    * ``skip_step`` -- do not apply this optimizer step;
    * ``save_checkpoint`` / ``checkpoint_reason`` -- take an emergency checkpoint now;
    * ``rollback_to`` / ``skip_batches`` -- restore the checkpoint of that step and skip the
      batches in ``[skip_batches[0], skip_batches[1]]``;
    * ``keep_position`` -- with ``rollback_to``: restore only the weights and the optimizer
      state of that checkpoint; the step counter, scheduler and data position go on (the
      faulty step is not replayed);
    * ``stop`` / ``stop_reason`` -- stop training cleanly.

    Examples
    --------
    >>> c = Control()
    >>> c.skip_step = True
    >>> c.reset_step()
    >>> c.skip_step, c.lr_factor
    (False, 1.0)
    """

    lr_factor: float = 1.0
    clip_norm: float | None = None
    skip_step: bool = False
    save_checkpoint: bool = False
    checkpoint_reason: str = ""
    rollback_to: int | None = None
    skip_batches: tuple[int, int] | None = None
    stop: bool = False
    stop_reason: str = ""
    keep_position: bool = False

    PER_STEP: ClassVar[tuple[str, ...]] = (
        "skip_step",
        "save_checkpoint",
        "checkpoint_reason",
        "rollback_to",
        "skip_batches",
        "keep_position",
        "stop",
        "stop_reason",
    )

    def reset_step(self) -> None:
        """Reset the per-step requests (persistent ``lr_factor`` / ``clip_norm`` are kept)."""
        self.skip_step = False
        self.save_checkpoint = False
        self.checkpoint_reason = ""
        self.rollback_to = None
        self.skip_batches = None
        self.stop = False
        self.stop_reason = ""
        self.keep_position = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["skip_batches"] = list(self.skip_batches) if self.skip_batches else None
        if not self.keep_position:  # (records without it are as before)
            d.pop("keep_position")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Control:
        c = cls()
        for f in dataclasses.fields(cls):
            if f.name in d:
                setattr(c, f.name, d[f.name])
        if c.skip_batches is not None:
            c.skip_batches = (int(c.skip_batches[0]), int(c.skip_batches[1]))
        return c


@dataclass(frozen=True)
class Decision:
    """Everything the monitor decided at one step."""

    step: int
    alarms: tuple[Alarm, ...] = ()
    interventions: tuple[Intervention, ...] = ()
    control: Control = field(default_factory=Control)
    skipped: tuple[str, ...] = ()  #: metric names recorded as skipped (bad input), with reason

    @property
    def healthy(self) -> bool:
        """``True`` when no alarm fired on this step."""
        return not self.alarms

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "alarms": [a.to_dict() for a in self.alarms],
            "interventions": [i.to_dict() for i in self.interventions],
            "control": self.control.to_dict(),
            "skipped": list(self.skipped),
        }
