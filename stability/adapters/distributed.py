"""Rank-consistent decisions: every rank takes the same action at the same step.

Choice: each rank runs its own :class:`~stability.monitor.Monitor` on its *local* signals (so a
NaN or a spike that only one rank sees -- a bad shard, a flipped bit in one replica -- is not
averaged away), and the resulting :class:`~stability.types.Control` requests are reduced across
ranks with **one** ``all_reduce`` of a small float64 vector per step (``ReduceOp.MIN``; fields
that need a maximum are negated):

==================  ===========================================================
field               reduction
==================  ===========================================================
``skip_step``       any rank (max)
``save_checkpoint`` any rank (max)
``stop``            any rank (max)
``rollback_to``     any rank asks -> everyone rolls back to the earliest target
``skip_batches``    union of the requested windows (min start, max end)
``lr_factor``       the smallest factor (min)
``clip_norm``       the tightest clip (min; ``None`` counts as +inf)
alarm flag          any rank alarmed (the step is unhealthy everywhere)
step                min and max compared: a mismatch raises (ranks out of step)
==================  ===========================================================

Only rank 0 should write records, event logs and alerts (:func:`is_rank_zero`); checkpoints are
taken by every rank at the same steps (each rank writes its own ``-rank<r>`` file) and a rollback
restores the same step everywhere.

Hangs: collectives block until every rank joins. Bound them with the process group timeout
(``init_process_group(..., timeout=timedelta(seconds=...))``): a rank that never arrives then
raises on the others instead of hanging.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..types import Control

__all__ = ["ControlSync", "is_rank_zero", "rank_and_world"]

_N = 11


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_rank_zero(group: Any = None) -> bool:
    """``True`` on the rank that writes records and alerts (always true without distributed)."""
    return rank_and_world(group)[0] == 0


class ControlSync:
    """Reduce a step's :class:`Control` across ranks with one ``all_reduce``.

    Parameters
    ----------
    group : ProcessGroup, optional
        The process group (default: the world).
    device : torch.device, optional
        Where the reduction tensor lives (default: CUDA for NCCL, else CPU).

    Examples
    --------
    Without an initialised process group the reduction is the identity:

    >>> sync = ControlSync()
    >>> c, any_alarm = sync.reduce(Control(lr_factor=0.5), step=3, alarmed=True)
    >>> c.lr_factor, any_alarm, sync.world_size
    (0.5, True, 1)
    """

    def __init__(self, group: Any = None, device: torch.device | None = None) -> None:
        self.group = group
        self.rank, self.world_size = rank_and_world(group)
        if device is None:
            device = torch.device("cpu")
            if self.world_size > 1 and dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.remote_requests = 0  #: steps where another rank's request changed this rank's control

    @property
    def active(self) -> bool:
        """``True`` when there is more than one rank."""
        return self.world_size > 1

    def reduce(self, control: Control, step: int, alarmed: bool) -> tuple[Control, bool]:
        """Return the control every rank will act on, and whether any rank alarmed.

        Parameters
        ----------
        control : Control
            This rank's requests (not modified).
        step : int
            This rank's step (must be the same on all ranks).
        alarmed : bool
            Whether this rank's monitor raised an alarm on this step.
        """
        if not self.active:
            return control, bool(alarmed)
        inf = math.inf
        has_rb = control.rollback_to is not None
        sb = control.skip_batches
        v = [
            -float(control.skip_step),
            -float(control.save_checkpoint),
            -float(control.stop),
            -float(has_rb),
            float(control.rollback_to) if has_rb else inf,  # type: ignore[arg-type]
            float(sb[0]) if sb else inf,
            -float(sb[1]) if sb else inf,
            float(control.lr_factor),
            inf if control.clip_norm is None else float(control.clip_norm),
            -float(bool(alarmed)),
            float(step),
        ]
        t = torch.tensor(v + [-float(step)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        r = t.tolist()
        if r[10] != -r[11]:
            raise RuntimeError(f"Ranks are out of step: steps {r[10]:.0f}..{-r[11]:.0f} at the "
                               f"same collective (rank {self.rank} is at step {step}).")
        out = Control(
            lr_factor=r[7],
            clip_norm=None if math.isinf(r[8]) else r[8],
            skip_step=r[0] < 0,
            save_checkpoint=r[1] < 0,
            checkpoint_reason=control.checkpoint_reason or ("another rank" if r[1] < 0 else ""),
            rollback_to=int(r[4]) if r[3] < 0 else None,
            skip_batches=(int(r[5]), int(-r[6])) if not math.isinf(r[5]) else None,
            stop=r[2] < 0,
            stop_reason=control.stop_reason or ("stop requested by another rank" if r[2] < 0
                                                else ""),
        )
        if out != control:
            self.remote_requests += 1
        return out, r[9] < 0
