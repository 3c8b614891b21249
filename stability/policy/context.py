"""The typed seam between the monitor and the policy: :class:`PolicyContext` and :class:`Ledger`.

On every alarm step the monitor hands :meth:`stability.policy.policy.Policy.step` what it knows
about
the run beyond the alarms: the checkpoint ledger, the scheduler's LR, the trainer's own clip and
the recent gradient norms.  :class:`PolicyContext` names those fields; direct users of the
policy may still pass a plain mapping with the same keys (:meth:`PolicyContext.coerce`), and a
``PolicyContext`` still reads like the mapping it replaces (``ctx["lr"]``, ``dict(ctx)``: only
the fields that are set).

:class:`Ledger` is what the policy needs of a checkpoint ledger
(:class:`~stability.run.checkpoints.CheckpointLedger` is the implementation).

Examples
--------
>>> ctx = PolicyContext.coerce({"lr": 0.2, "lr_prev": 0.1, "grad_norm": float("nan")})
>>> ctx.lr, ctx.grad_norm, ctx.clip_norm
(0.2, None, None)
>>> dict(ctx)
{'lr': 0.2, 'lr_prev': 0.1}
>>> PolicyContext.coerce(ctx) is ctx
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["CheckpointRef", "Ledger", "PolicyContext"]


class CheckpointRef(Protocol):
    """A checkpoint the ledger knows (:class:`~stability.run.checkpoints.CheckpointRecord`)."""

    @property
    def step(self) -> int:
        """Step the checkpoint was saved at (its identity in the ledger)."""
        ...

    @property
    def covers(self) -> int:
        """Last step whose update the saved state contains."""
        ...


@runtime_checkable
class Ledger(Protocol):
    """What the policy asks of a checkpoint ledger."""

    def note_alarm(self, step: int) -> None:
        """Alarms fired at ``step``: checkpoints near it are not healthy."""
        ...

    def latest_healthy_before(self, step: int, margin: int | None = None
                              ) -> CheckpointRef | None:
        """The latest healthy checkpoint covering a step ``< step - margin``."""
        ...

    def rewind(self, to_step: int) -> object:
        """A rollback restarted the step count at ``to_step``: forget what came after."""
        ...


_FLOATS = ("lr", "lr_prev", "clip_norm", "grad_norm", "grad_norm_recent_median")


@dataclass(frozen=True)
class PolicyContext(Mapping[str, Any]):
    """What the monitor knows about the run on an alarm step; every field optional.

    Parameters
    ----------
    healthy_checkpoints
        The checkpoint ledger: the policy notes alarm steps in it, looks up rollback targets and
        rewinds it on a rewinding rollback.
    lr, lr_prev
        The scheduler's raw LR of this step and of the previous observed step (they size the
        cut of an LR jump exactly).
    clip_norm
        The trainer's own gradient clip (the policy never loosens it).
    grad_norm
        This step's gradient norm (the latest finite one when this step's is not).
    grad_norm_recent_median
        Median of the recent finite gradient norms (the adaptive clip is a factor of it).

    Non-finite numbers read as unknown (``None``) in :meth:`coerce`; the policy ignores them
    whichever way they arrive.
    """

    healthy_checkpoints: Ledger | None = None
    lr: float | None = None
    lr_prev: float | None = None
    clip_norm: float | None = None
    grad_norm: float | None = None
    grad_norm_recent_median: float | None = None

    @classmethod
    def coerce(cls, context: PolicyContext | Mapping[str, Any] | None) -> PolicyContext:
        """A ``PolicyContext`` from one, from a mapping with the same keys, or from ``None``.

        Unknown keys are ignored; a number that is not a finite float (or a value that is not a
        number at all) reads as ``None``.
        """
        if isinstance(context, PolicyContext):
            return context
        if not context:
            return _EMPTY
        return cls(healthy_checkpoints=context.get("healthy_checkpoints"),
                   **{k: finite_or_none(context.get(k)) for k in _FLOATS})

    # ------------------------------------------------------------------ read-only mapping view
    def __getitem__(self, key: str) -> Any:
        v = getattr(self, key, None) if key in _KEYS else None
        if v is None:
            raise KeyError(key)
        return v

    def __iter__(self) -> Iterator[str]:
        return (k for k in _KEYS if getattr(self, k) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_KEYS = tuple(f.name for f in dataclasses.fields(PolicyContext))
_EMPTY = PolicyContext()


def finite_or_none(v: Any) -> float | None:
    """``float(v)`` when that is finite, else ``None`` (also for non-numbers)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return f if math.isfinite(f) else None
