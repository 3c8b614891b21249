"""The skip gate of a ``sync="deferred"`` guard: a late ``skip_step`` skips the next bad batch.

With ``sync="deferred"`` the policy's ``skip_step`` for step ``s`` is known during step
``s + 1``, after step ``s``'s update landed.  A lone outlier batch costs one bounded update (the
device-side spike clip of :mod:`stability.adapters.guard.deferred`), but a *run* of bad batches -- a
corrupt data shard -- would land every update the policy asks to skip: the model starts fitting
the garbage, the loss comes down, the alarms stop and the escalation (adapt, roll back, stop
with the healthy weights) that ``sync="step"`` reaches never comes.

The gate: when the decision observed during step ``t`` (step ``t - 1``'s) asked to skip, step
``t``'s update is skipped *on the device* when its loss is above :data:`LOSS_GATE_FACTOR`
times the median loss of the last healthy observed steps (or not finite) -- no host sync:

* fused optimizers (``_step_supports_amp_scaling``, no ``GradScaler``) get the flag in
  ``optimizer.found_inf``: the kernel skips the update, weights and state untouched;
* other optimizers: the weights and the optimizer state (tensors on the weights' device) are
  copied before the step and put back after it where the flag is set (``torch.where``): an exact
  skip (an optimizer's step counter kept on another device, e.g. Adam's CPU ``step`` of CUDA
  weights, still advances).  Only gated steps pay for the copy; without memory for it the
  gradients are zeroed instead (momentum and weight decay then still move the weights).

The gate never acts on a step the policy did not ask to skip before: it is armed only by a
``skip_step`` (a healthy run never has one: it stays bit-identical to ``sync="step"``) and
disarms as soon as the policy stops skipping (a persistent shift it adapts to), so it skips at
most one step more than the policy asked for.  Distributed: the arming comes from the reduced
control (the same step on every rank) and the flag is reduced with ``all_reduce(MAX)`` on the
device (no host sync): every rank skips, or none.  When the gated step is observed, the host
recomputes the flag from the step's loss (its own rank's) -- the update ratio of a skipped step
is not reported and its ``skip_step`` counts as carried out.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stability._state_check import Fields

__all__ = ["LOSS_GATE_FACTOR", "LOSS_MIN", "LOSS_WINDOW", "GateState", "SkipGate", "parse_gate"]

log = logging.getLogger("stability.adapters")

#: A step after a ``skip_step`` is skipped on the device when its loss is above this many
#: times the median loss of the last :data:`LOSS_WINDOW` healthy observed steps.
LOSS_GATE_FACTOR = 3.0
LOSS_WINDOW = 32
#: The gate arms once this many healthy losses are known.
LOSS_MIN = 16


class SkipGate:
    """Device-side skip of the steps after a late ``skip_step`` (see the module docstring).

    Parameters
    ----------
    factor : float or None
        :data:`LOSS_GATE_FACTOR`; ``None`` turns the gate off.

    Attributes
    ----------
    gated : int
        Observed steps whose update the gate skipped (this rank's count).
    """

    def __init__(self, factor: float | None = LOSS_GATE_FACTOR) -> None:
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ValueError("The 'factor' parameter of SkipGate must be a float in the range "
                             f"(0, inf) or None. Got {factor!r} instead.")
        self.factor = factor
        self.gated = 0
        self._losses: deque[float] = deque(maxlen=LOSS_WINDOW)  # healthy observed losses
        self._healthy = 0  # healthy observed steps (at most LOSS_MIN): the same on every rank
        self._armed: tuple[int, float] | None = None  # (step, threshold) of the armed step
        self._fire: torch.Tensor | None = None  # the armed step's device flag
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live, copy)

    # ------------------------------------------------------------------ step t
    def threshold(self) -> float | None:
        """The loss above which an armed step is skipped (``None``: not known yet / off)."""
        if self.factor is None or self._healthy < LOSS_MIN:
            return None
        med = statistics.median(self._losses) if self._losses else math.nan
        if not (math.isfinite(med) and med > 0):
            return math.inf  # (a loss that can be <= 0: only non-finite losses are gated)
        return float(np.float32(self.factor * med))  # the device compares in float32

    def arm(self, step: int, skip_asked: bool, vec: torch.Tensor, names: list[str],
            host: Mapping[str, float], sync: Any = None) -> torch.Tensor | None:
        """Step ``step``'s device flag (``True``: skip its update) when the last observed
        decision asked to skip; ``None`` when the gate is not armed.  ``sync``: the guard's
        :class:`~stability.adapters.distributed.ControlSync` (its group reduces the flag;
        ``None``: one rank)."""
        self._armed, self._fire = None, None
        thr = self.threshold() if skip_asked else None
        if thr is None:
            return None
        if "loss" in names:
            loss = vec[names.index("loss")]
            fire = ~(loss <= thr)  # NaN fires
        elif "loss" in host:
            fire = torch.tensor(not host["loss"] <= thr, device=vec.device)
        else:
            return None
        if sync is not None:
            import torch.distributed as dist

            flag = fire.to(torch.float32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=sync.group)  # async on the device
            fire = flag > 0
        self._armed, self._fire = (step, thr), fire
        return fire

    def hold(self, optimizer: torch.optim.Optimizer) -> bool:
        """Copy the weights and optimizer state the armed step may change (put back by
        :meth:`release` where the flag is set); ``False`` when there is no memory for it."""
        if self._fire is None:
            return True
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        live = [p.data] + [v for v in optimizer.state.get(p, {}).values()
                                           if isinstance(v, torch.Tensor)
                                           and v.device == p.device and v.numel() > 0]
                        saved.extend((t, t.clone()) for t in live)
        except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
            log.warning("no memory to hold the weights of a gated step: its gradients are "
                        "zeroed instead", exc_info=True)
            return False
        self._saved = saved
        return True

    def release(self) -> None:
        """After the optimizer step: put the held tensors back where the flag is set."""
        saved, self._saved = self._saved, []
        if not saved or self._fire is None:
            return
        flags: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for live, copy in saved:
                f = flags.get(live.device)
                if f is None:
                    f = flags[live.device] = self._fire.to(live.device)
                live.copy_(torch.where(f, copy, live))

    # ------------------------------------------------------------------ observed
    def observed(self, step: int, scalars: Mapping[str, float]) -> bool:
        """Whether ``step``'s update was gated (recomputed on the host from its loss)."""
        armed = self._armed
        if armed is None or armed[0] != step:
            return False
        self._armed = None
        loss = scalars.get("loss", math.nan)
        fired = not loss <= armed[1]
        self.gated += fired
        return fired

    def note(self, scalars: Mapping[str, float], healthy: bool) -> None:
        """A healthy observed step's loss joins the median."""
        if not healthy:
            return
        self._healthy = min(self._healthy + 1, LOSS_MIN)  # (arms every rank at the same step)
        loss = scalars.get("loss")
        if loss is not None and math.isfinite(loss):
            self._losses.append(float(loss))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The healthy losses, the armed step (not observed yet) and the count (JSON-safe)."""
        armed = self._armed
        return {"losses": list(self._losses), "healthy": self._healthy, "gated": self.gated,
                "armed": None if armed is None else
                {"step": armed[0], "threshold": armed[1] if math.isfinite(armed[1]) else "inf"}}

    def load_state_dict(self, sd: GateState) -> None:
        """Restore :func:`parse_gate` output."""
        losses, self._healthy, self.gated, self._armed = sd
        self._losses = deque(losses, maxlen=LOSS_WINDOW)
        self._fire, self._saved = None, []


#: checked :meth:`SkipGate.state_dict` output: (healthy losses, healthy steps, gated, armed step)
GateState = tuple[list[float], int, int, tuple[int, float] | None]


def parse_gate(f: Fields) -> GateState:
    """Check :meth:`SkipGate.state_dict` output (``f``: its fields; an empty mapping when absent,
    as in snapshots from before the gate); ``ValueError`` names a bad field."""
    losses = [f.number(f"losses[{i}]", x)
              for i, x in enumerate(f.seq("losses", None, f.get("losses", [])))]
    armed = None
    if f.get("armed", None) is not None:
        af = f.sub("armed")
        armed = (af.integer("step", lo=0), af.number("threshold", lo=0.0, inf=True))
    healthy = f.integer("healthy", f.get("healthy", len(losses)), lo=0)
    return (losses[-LOSS_WINDOW:], min(healthy, LOSS_MIN),
            f.integer("gated", f.get("gated", 0), lo=0), armed)
