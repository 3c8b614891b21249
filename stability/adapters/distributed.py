"""Rank-consistent decisions: every rank takes the same action at the same step.

Choice: each rank runs its own :class:`~stability.monitor.monitor.Monitor` on its *local* signals
(so a
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
retention anchors   the earliest and the latest of every rank's (``sync.anchors``)
==================  ===========================================================

Retention anchors: the steps before which each rank's policy may still need a checkpoint (its
episode onset, its best validation point) are per-rank monitor state; checkpoint retention
protects the latest healthy checkpoint before the reduced ones, so every rank keeps the same
checkpoints (identical ledgers: a rollback restores the same step everywhere).

Only rank 0 should write records, event logs and alerts (:func:`is_rank_zero`); checkpoints are
taken by every rank at the same steps (each rank writes its own ``-rank<r>`` file) and a rollback
restores the same step everywhere.

Which rank is the culprit (``ControlSync(ranks=True)``): each rank also contributes a small vector
of *local* signals (:data:`stability.ranks.ranks.RANK_SIGNALS`: its loss, its gradient norm before
the
all-reduce -- from :func:`register_local_grad_norm_hook` on a DDP model, else the value the caller
passes -- its busy time, its data-wait time, a non-finite flag). The control fields and these
signals travel together in **one** ``all_gather_into_tensor`` of a ``(world, 19)`` float64 tensor;
every rank then reduces the control locally (the same column-wise minimum the ``all_reduce``
computes) and runs the same :class:`~stability.ranks.ranks.RankMonitor` on the same matrix, so the
rank-outlier alarms (``sync.rank_alarms``) and the health ledger are identical everywhere. Host
names are exchanged once, at construction (``all_gather_object``).

Busy time: with DDP, fast ranks wait for the slow one inside the gradient all-reduce, so wall step
time is the same everywhere. The busy time is the time from the end of the previous gather to the
first gradient bucket reaching the communication hook, plus the time from the last bucket's
all-reduce completing to this rank entering the gather -- the local work, without the waits.
Without the hook it is the wall time between gathers (or what the caller passes).

Hangs: collectives block until every rank joins. Bound them with the process group timeout
(``init_process_group(..., timeout=timedelta(seconds=...))``): a rank that never arrives then
raises on the others instead of hanging.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from stability.ranks.ranks import RankMonitor
from stability.types import Alarm, Control

__all__ = ["ControlSync", "RankSignals", "is_rank_zero", "rank_and_world",
           "register_local_grad_norm_hook"]

_N = 11
_NC = 14  # control columns of the gathered row (the 11 fields, -step, the two anchors)
_T = TypeVar("_T")


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def is_rank_zero(group: Any = None) -> bool:
    """``True`` on the rank that writes records and alerts (always true without distributed)."""
    return rank_and_world(group)[0] == 0


def _scalar(v: Any) -> Any:
    """A float or a 0-d float64 tensor (no host sync for a device tensor)."""
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(torch.float64)
    return math.nan if v is None else float(v)


class RankSignals:
    """This rank's local step signals: what it contributes to the per-step gather.

    Filled by :func:`register_local_grad_norm_hook` (local gradient norm, communication times), by
    :meth:`batches` / :meth:`note_data_wait` (data-wait time) and by the values passed to
    :meth:`ControlSync.reduce`; reset after every gather.

    Examples
    --------
    >>> sig = RankSignals()
    >>> for batch in sig.batches(range(2)):
    ...     pass
    >>> v = sig.vector(loss=0.5)
    >>> len(v), v[0], v[4]
    (5, 0.5, 0.0)
    """

    def __init__(self) -> None:
        self.hooked = False  #: a DDP communication hook feeds :attr:`grad_sq`
        self.grad_sq: Any = None  #: local squared gradient norm of this step (tensor)
        self.nonfinite = False
        self.start_step()

    def start_step(self) -> None:
        """Reset the accumulators; the busy-time clock starts now."""
        self.t_start = time.perf_counter()
        self.t_first_comm: float | None = None
        self.t_comm_done: float | None = None
        self.data_wait = 0.0
        self.grad_sq = None
        self.nonfinite = False

    def note_data_wait(self, seconds: float) -> None:
        """Add time this rank spent waiting for its data on this step."""
        self.data_wait += float(seconds)

    def batches(self, iterable: Iterable[_T]) -> Iterator[_T]:
        """Yield from ``iterable``, counting the time spent in ``next()`` as data wait."""
        it = iter(iterable)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self.data_wait += time.perf_counter() - t0
            yield item

    def on_bucket(self, buffer: torch.Tensor) -> None:
        """A gradient bucket, *before* averaging, reached the communication hook."""
        if self.t_first_comm is None:
            self.t_first_comm = time.perf_counter()
        sq = buffer.detach().float().pow(2).sum()
        self.grad_sq = sq if self.grad_sq is None else self.grad_sq + sq

    def on_bucket_done(self) -> None:
        """A bucket's all-reduce completed."""
        self.t_comm_done = time.perf_counter()

    def busy_time(self, now: float | None = None) -> float:
        """Local work since :meth:`start_step`, without the wait in the gradient all-reduce."""
        now = time.perf_counter() if now is None else now
        if self.t_first_comm is not None and self.t_comm_done is not None:
            return (self.t_first_comm - self.t_start) + max(now - self.t_comm_done, 0.0)
        return now - self.t_start

    def vector(self, loss: Any = None, grad_norm: Any = None, step_time: float | None = None,
               data_wait: float | None = None, nonfinite: bool | None = None) -> list[Any]:
        """The row this rank contributes (columns :data:`~stability.ranks.ranks.RANK_SIGNALS`).

        ``grad_norm`` is used only when no hook measured the local norm; ``None`` means missing
        (``nan``). Entries are floats or 0-d tensors.
        """
        if self.grad_sq is not None:
            gn = self.grad_sq.to(torch.float64).sqrt()
        else:
            gn = _scalar(grad_norm)
        nf = self.nonfinite if nonfinite is None else bool(nonfinite)
        return [
            _scalar(loss), gn,
            self.busy_time() if step_time is None else float(step_time),
            self.data_wait if data_wait is None else float(data_wait),
            float(nf),
        ]


def register_local_grad_norm_hook(ddp_model: Any, signals: RankSignals | None = None,
                                  process_group: Any = None,
                                  hook: Callable[..., Any] | None = None) -> RankSignals:
    """Register a DDP communication hook that measures this rank's *local* gradient norm.

    Each bucket's squared norm is accumulated (on the device, no host sync) before the bucket is
    averaged, and the times the first bucket arrives and the last all-reduce completes are noted
    (for :meth:`RankSignals.busy_time`). The averaging itself is done by ``hook`` (default: DDP's
    ``allreduce_hook``), so training is unchanged.

    Parameters
    ----------
    ddp_model : DistributedDataParallel
        The wrapped model (a DDP model accepts one communication hook).
    signals : RankSignals, optional
        Where to accumulate (default: a new one); pass it to :class:`ControlSync`.
    process_group : ProcessGroup, optional
        The group the gradients are averaged over (default: the world).
    hook : callable, optional
        The communication hook to wrap, ``hook(process_group, bucket) -> Future[Tensor]``.

    Returns
    -------
    RankSignals
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    sig = signals if signals is not None else RankSignals()
    inner = hook if hook is not None else allreduce_hook

    def _done(fut: Any) -> Any:
        sig.on_bucket_done()
        return fut.value()

    def _hook(state: Any, bucket: Any) -> Any:
        sig.on_bucket(bucket.buffer())
        return inner(state, bucket).then(_done)

    # DDP checks the hook's annotations (strings here, under postponed evaluation)
    _hook.__annotations__ = {"bucket": dist.GradBucket,
                             "return": torch.futures.Future[torch.Tensor]}
    ddp_model.register_comm_hook(process_group, _hook)
    sig.hooked = True
    return sig


def _gather(out: torch.Tensor, row: torch.Tensor, group: Any) -> None:
    """One all-gather of ``row`` into ``out`` (``(world, k)``), list-based where unsupported."""
    try:  # all_gather_single is the newer name (torch >= 2.10) of all_gather_into_tensor
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, row, group=group)
    except (RuntimeError, NotImplementedError, AttributeError):  # pragma: no cover - old gloo
        parts = list(out.unbind(0))
        dist.all_gather(parts, row, group=group)


class ControlSync:
    """Reduce a step's :class:`Control` across ranks with one collective.

    Parameters
    ----------
    group : ProcessGroup, optional
        The process group (default: the world).
    device : torch.device, optional
        Where the reduction tensor lives (default: CUDA for NCCL, else CPU).
    ranks : bool or RankMonitor, optional
        Gather per-rank signals with the control and name the culprit rank (``True``: a default
        :class:`~stability.ranks.ranks.RankMonitor`; or pass one built with this run's hosts).
    signals : RankSignals, optional
        This rank's signal accumulator (from :func:`register_local_grad_norm_hook`).
    skip_on : sequence of str
        Rank-outlier signals that also skip the step on every rank (the corrupted gradient is
        already in the average).

    Examples
    --------
    Without an initialised process group the reduction is the identity:

    >>> sync = ControlSync()
    >>> c, any_alarm = sync.reduce(Control(lr_factor=0.5), step=3, alarmed=True)
    >>> c.lr_factor, any_alarm, sync.world_size
    (0.5, True, 1)
    """

    def __init__(self, group: Any = None, device: torch.device | None = None,
                 ranks: bool | RankMonitor = False, signals: RankSignals | None = None,
                 skip_on: Sequence[str] = ("nonfinite", "grad_norm")) -> None:
        self.group = group
        self.rank, self.world_size = rank_and_world(group)
        if device is None:
            device = torch.device("cpu")
            if self.world_size > 1 and dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.remote_requests = 0  #: steps where another rank's request changed this rank's control
        self.signals = signals if signals is not None else RankSignals()
        self.skip_on = tuple(skip_on)
        self.rank_alarms: tuple[Alarm, ...] = ()  #: this step's rank-outlier alarms
        #: the earliest and latest retention anchor of all ranks at the last step (or ``()``)
        self.anchors: tuple[int, ...] = ()
        self.gathered: list[list[float]] = []  #: this step's per-rank signal rows
        self.hosts: list[str] = [socket.gethostname()]
        self.ranks: RankMonitor | None = None
        if ranks is not False and ranks is not None and self.active:
            names: list[Any] = [None] * self.world_size
            dist.all_gather_object(names, socket.gethostname(), group=group)
            self.hosts = [str(h) for h in names]
            self.ranks = ranks if isinstance(ranks, RankMonitor) else RankMonitor(self.hosts)
            if self.ranks.world_size != self.world_size:
                raise ValueError(f"The RankMonitor has {self.ranks.world_size} hosts; the group "
                                 f"has {self.world_size} ranks.")

    @property
    def active(self) -> bool:
        """``True`` when there is more than one rank."""
        return self.world_size > 1

    def reduce(self, control: Control, step: int, alarmed: bool, *, loss: Any = None,
               grad_norm: Any = None, step_time: float | None = None,
               data_wait: float | None = None,
               nonfinite: bool | None = None,
               anchors: Sequence[int] = ()) -> tuple[Control, bool]:
        """Return the control every rank will act on, and whether any rank alarmed.

        Parameters
        ----------
        control : Control
            This rank's requests (not modified).
        step : int
            This rank's step (must be the same on all ranks).
        alarmed : bool
            Whether this rank's monitor raised an alarm on this step.
        loss, grad_norm, step_time, data_wait, nonfinite : optional
            This rank's local signals (with ``ranks``): floats or 0-d tensors. ``grad_norm`` is
            the *local* norm, used when no DDP hook measured it; ``step_time`` and
            ``data_wait`` default to what :class:`RankSignals` measured.
        anchors : sequence of int
            This rank's checkpoint-retention anchors (its policy's ``rollback_anchors()``);
            the earliest and latest over the ranks are kept in :attr:`anchors`.
        """
        self.rank_alarms = ()
        if not self.active:
            self.anchors = (min(anchors), max(anchors)) if anchors else ()
            return control, bool(alarmed)
        inf = math.inf
        has_rb = control.rollback_to is not None
        sb = control.skip_batches
        v = [
            -float(control.skip_step),
            -float(control.save_checkpoint),
            -float(control.stop),
            # -1: a rollback; -0.5: a restore keeping the position (any plain rollback wins)
            -(0.5 if control.keep_position else 1.0) * float(has_rb),
            float(control.rollback_to) if has_rb else inf,  # type: ignore[arg-type]
            float(sb[0]) if sb else inf,
            -float(sb[1]) if sb else inf,
            float(control.lr_factor),
            inf if control.clip_norm is None else float(control.clip_norm),
            -float(bool(alarmed)),
            float(step),
        ]
        head = v + [-float(step), float(min(anchors)) if anchors else inf,
                    -float(max(anchors)) if anchors else inf]
        if self.ranks is None:
            t = torch.tensor(head, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            r = t.tolist()
        else:
            r = self._gather_rows(head, loss, grad_norm, step_time, data_wait, nonfinite)
        self.anchors = () if math.isinf(r[12]) else (int(r[12]), int(-r[13]))
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
            keep_position=r[3] == -0.5,
            stop_reason=control.stop_reason or ("stop requested by another rank" if r[2] < 0
                                                else ""),
        )
        any_alarm = r[9] < 0
        if self.ranks is not None:
            self.rank_alarms = self.ranks.observe(step, [row[_NC:] for row in self.gathered])
            if self.rank_alarms:
                any_alarm = True
                if any(a.signal.split("/", 1)[1] in self.skip_on for a in self.rank_alarms):
                    out.skip_step = True
        if out != control:
            self.remote_requests += 1
        return out, any_alarm

    def _gather_rows(self, head: list[float], loss: Any, grad_norm: Any,
                     step_time: float | None, data_wait: float | None,
                     nonfinite: bool | None) -> list[float]:
        """One all-gather of control + signals; returns the column-wise minimum of the control."""
        cells = head + self.signals.vector(loss, grad_norm, step_time, data_wait, nonfinite)
        tensors = [i for i, c in enumerate(cells) if isinstance(c, torch.Tensor)]
        row = torch.tensor([math.nan if i in tensors else c for i, c in enumerate(cells)],
                           dtype=torch.float64).to(self.device)
        if tensors:  # device scalars (loss, local grad norm) join without a host sync
            row[tensors] = torch.stack([cells[i].to(self.device) for i in tensors])
        out = torch.empty((self.world_size, row.numel()), dtype=torch.float64, device=self.device)
        _gather(out, row, self.group)
        self.gathered = out.tolist()  # the one host sync
        self.signals.start_step()
        return [min(col) for col in zip(*(g[:_NC] for g in self.gathered), strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """The rank monitor's state (empty without ``ranks``)."""
        return {} if self.ranks is None else {"ranks": self.ranks.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        if self.ranks is not None and "ranks" in sd:
            self.ranks.load_state_dict(sd["ranks"])
