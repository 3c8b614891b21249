"""The ``stability/*`` feedback metrics of :class:`~stability.adapters.torch.TorchGuard`.

:class:`GuardFeedback` is a collaborator the guard holds (``guard.feedback``):
:meth:`~GuardFeedback.metrics` gives the latest decision's
:func:`stability.outputs.feedback.feedback_metrics` plus the LR actually applied and the goodput
counters (read from the goodput ledger), for any logger; ``guard.metrics()`` is its shortcut.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from stability.adapters.interventions import LRMultiplier
from stability.outputs.feedback import InterventionTally, feedback_metrics
from stability.run.goodput import GoodputTracker
from stability.types import Decision

__all__ = ["FeedbackSource", "GuardFeedback"]

log = logging.getLogger("stability.adapters")


class FeedbackSource(Protocol):
    """What :class:`GuardFeedback` reads of its guard (a
    :class:`~stability.adapters.torch.TorchGuard`): the latest decision, the LR, the goodput
    ledger, the intervention counts and the AMP scaler's state."""

    @property
    def monitor(self) -> Any: ...

    @property
    def decision(self) -> Decision | None: ...

    @property
    def multiplier(self) -> LRMultiplier: ...

    @property
    def goodput(self) -> GoodputTracker: ...

    @property
    def tally(self) -> InterventionTally: ...

    @property
    def scaler(self) -> Any: ...

    @property
    def amp_overflow(self) -> bool: ...

    @property
    def amp_overflows(self) -> int: ...


class GuardFeedback:
    """The feedback metrics of one :class:`~stability.adapters.torch.TorchGuard`."""

    def __init__(self, guard: FeedbackSource) -> None:
        self.guard = guard

    def metrics(self, scores: bool = True) -> dict[str, float]:
        """This step's ``stability/*`` metrics, for TensorBoard / W&B / any logger.

        :func:`stability.outputs.feedback.feedback_metrics` of the latest decision, plus the LR
        actually
        applied (``stability/lr_effective``), the scheduler's LR (``stability/lr_base``),
        intervention counts by type and the goodput counters (``steps_skipped``, ``rollbacks``,
        ``steps_lost``, ``checkpoints``, ...); with a scaler also ``amp_overflow`` /
        ``loss_scale`` / ``amp_overflows``.

        Examples
        --------
        >>> import torch
        >>> from stability.adapters.torch import TorchGuard
        >>> from stability.monitor.monitor import Monitor
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> guard = TorchGuard(model, opt, monitor=Monitor("small"), log_interventions=False)
        >>> loss = model(torch.ones(4, 2)).pow(2).mean(); loss.backward(); _ = guard.step(loss)
        >>> m = guard.feedback.metrics()
        >>> m["stability/lr_effective"], m["stability/lr_factor"], m["stability/steps_skipped"]
        (0.1, 1.0, 0.0)
        """
        guard = self.guard
        lrs = guard.multiplier.base_lrs()
        g = guard.goodput  # the one goodput ledger (the monitor's)
        extra: dict[str, float] = {
            "lr_effective": lrs[0] * guard.multiplier.factor if lrs else float("nan"),
            "lr_base": lrs[0] if lrs else float("nan"),
            "steps_skipped": g.skipped,
            "batches_skipped": g.batches_skipped,
            "rollbacks": g.rollbacks,
            "steps_lost": g.lost,
            "checkpoints": g.checkpoints,
            "checkpoint_failures": g.checkpoint_failures,
        }
        extra.update(guard.tally.metrics())
        if guard.scaler is not None:
            extra["amp_overflow"] = float(guard.amp_overflow)
            extra["amp_overflows"] = float(guard.amp_overflows)
            try:
                extra["loss_scale"] = float(guard.scaler.get_scale())
            except Exception:
                log.debug("could not read the loss scale", exc_info=True)
        try:
            return feedback_metrics(guard.monitor, guard.decision, extra, scores=scores)
        except Exception:  # feedback must never kill the run
            log.debug("feedback metrics failed", exc_info=True)
            return {f"stability/{k}": float(v) for k, v in extra.items()
                    if not math.isnan(float(v))}
