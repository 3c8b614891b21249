"""Prime a monitor's detectors from earlier history, so it alarms from its first live step.

Every detector needs some history before it scores: the EWMA z-scores wait ``warmup`` finite
values (40 in the default preset, 100 in ``llm_pretrain``), the robust z-score a window,
Page-Hinkley ``min_instances``, the train/val detectors a few validation points.  A monitor
adopted late in a run, or rebuilt after a restart without its saved state, is blind for that
long.  :func:`calibrate` feeds earlier history -- the run's own logs, or a previous run of the
same recipe -- through every detector bank *without* emitting anything: no alarm reaches the
policy, no intervention is requested, no event is logged and no handler or alert sink is
called.  The detectors' running statistics, the signal layout they are bound to and the recent
global gradient norms the policy's context reads change.  With ``resume=True`` (the default:
the history is this run's own and the next step continues it -- a restart, a late adoption)
the policy's LR guard and loss tracker are primed too: the guard knows the last healthy LR and
the schedule's peak, so a restart that comes back with the wrong LR is an LR fault on its first
step, and the "measurably worse" test that gates rollbacks and stops has its baseline.  With
``resume=False`` (a previous run of the same recipe; the next run starts again) the policy is
left alone.  The control, the checkpoint ledger, the step counter and the counters stay as they
were, so the next :meth:`~stability.monitor.monitor.Monitor.observe` can be any step.

Examples
--------
>>> import numpy as np
>>> from stability.monitor.monitor import Monitor
>>> rng = np.random.default_rng(0)
>>> hist = {"step": np.arange(200), "loss": 3.0 + 0.01 * rng.standard_normal(200)}
>>> mon = Monitor("default", alert_sinks=[])
>>> calibrate(mon, hist)
200
>>> mon.observe(0, {"loss": 30.0}).alarms[0].kind     # a fresh monitor would be warming up
'loss_spike'
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from detectors.validation import param_error
from stability.monitor.io import table_columns
from stability.policy.policy import Policy

__all__ = ["Calibrated", "calibrate"]


class Calibrated(Protocol):
    """What :func:`calibrate` reads and sets of a monitor (a
    :class:`~stability.monitor.monitor.Monitor`): its binder and detector banks, the slots of
    the LR, loss and global grad norm, the policy, and the recent LRs and grad norm its
    policy context reads."""

    _lr_now: float | None
    _lr_prev: float | None
    _grad_last: float | None

    @property
    def policy(self) -> Policy: ...

    @property
    def _lr_slot(self) -> int: ...

    @property
    def _loss_slot(self) -> int: ...

    def bind_table(self, data: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]: ...

    def detector(self, binding: str) -> Any: ...

    def _table_slots(self, steps: Any, cols: list[tuple[str, Any, Any]]
                     ) -> tuple[Any, Any, Any]: ...


def _batches(data: Any) -> Iterable[Any]:
    if isinstance(data, Mapping) or hasattr(data, "column_names"):
        return [data]
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        err = param_error("calibrate", "data", "a table (dict of arrays or pyarrow Table) or "
                          "an iterable of tables", data)
        raise TypeError(f"{err}  Read a recorded run first (replay.io.read_table(path)).")
    return data


def calibrate(monitor: Calibrated, data: Any, *, resume: bool = True) -> int:
    """Feed ``data`` through every detector bank of ``monitor`` without emitting anything.

    Parameters
    ----------
    monitor
        The monitor to prime (normally fresh, or just restored).
    data
        Earlier history: a wide table (dict of NumPy columns with ``step``, or a pyarrow
        ``Table``; nulls = not logged) or an iterable of such tables, fed in order.  Rows are
        used in the order given; the steps only have to increase within each table.
    resume
        The history is this run's own and the next observed step continues it: also prime
        the policy's LR guard (every finite positive ``lr`` accepted as healthy) and loss
        tracker (every finite ``loss`` as a quiet step), as a replay of healthy history would
        leave them.  ``False`` for a previous run of the same recipe: the policy is untouched.

    Returns
    -------
    int
        The number of rows fed.

    Notes
    -----
    The detectors see the history exactly as :meth:`Monitor.replay` would feed it (the same
    binder, :meth:`Monitor.bind_table`), so their statistics after calibration equal those
    after a replay of the same rows; only the decisions are discarded.  History with a fault
    in it primes the detectors with the fault (they are robust to short spikes, not to long
    stretches of a different regime): calibrate on healthy history.
    """
    rows = 0
    for batch in _batches(data):
        steps, bound = monitor.bind_table(batch)
        if steps.size == 0:
            continue
        for name, (x, miss) in bound.items():
            det = monitor.detector(name)
            if x.shape[2] == 0:
                continue
            det.update_many(*[np.ascontiguousarray(x[:, j, :]) for j in range(x.shape[1])],
                            missing=miss)
        _prime_grad_history(monitor, batch)
        if resume:
            _prime_policy(monitor, batch)
        rows += int(steps.size)
    return rows


def _prime_policy(monitor: Calibrated, batch: Any) -> None:
    """The LR guard's healthy trajectory, the requested LRs the policy's context reads and the
    loss tracker, as a replay of the same (healthy) rows would have left them."""
    ls, lo = int(monitor._lr_slot), int(monitor._loss_slot)
    if not (ls or lo):
        return
    _, vals, pres = monitor._table_slots(*table_columns(batch))
    policy = monitor.policy
    guard = policy.guard if policy.config.lr_guard.enabled else None
    for t in range(vals.shape[0]):
        if ls and pres[t, ls]:
            lr = float(vals[t, ls])
            monitor._lr_prev, monitor._lr_now = monitor._lr_now, lr
            if guard is not None:
                guard.prime(lr)
        if lo and pres[t, lo]:
            loss = float(vals[t, lo])
            if np.isfinite(loss):
                policy.loss.update(loss, quiet=True)


def _prime_grad_history(monitor: Calibrated, batch: Any) -> None:
    """The recent finite global grad norms the policy's context uses (e.g. to pick a clip
    norm), as a replay of the same rows would have left them."""
    hist = getattr(monitor, "_grad_hist", None)
    g = int(getattr(monitor, "_grad_slot", 0))
    if hist is None or not g:
        return
    _, vals, pres = monitor._table_slots(*table_columns(batch))
    col = vals[pres[:, g], g]
    col = col[np.isfinite(col)]
    if col.size:
        hist.extend(col[-(hist.maxlen or col.size):].tolist())
        monitor._grad_last = float(col[-1])
