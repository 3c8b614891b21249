"""Batch replay of a recorded run through the monitor (the replay half of
:class:`stability.monitor.Monitor`, a mixin).

Each bank runs ``update_many`` once over the whole table; the per-step tail (alarms, policy,
goodput, decision, event log) is :meth:`Monitor._finish_step`, the same method
:meth:`~stability.monitor.Monitor.observe` ends with, so a replay gives the decisions of a
step-by-step ``observe()`` loop bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .monitor_io import is_table, table_columns
from .monitor_layout import _SCRATCH, MAX_STEP, LayoutMixin, _Binding
from .types import Control, Decision, Intervention

__all__ = ["ReplayMixin"]


class ReplayMixin(LayoutMixin):
    """:meth:`replay`, :meth:`replay_batches` and :meth:`bind_table`."""

    last_step: int
    control: Control
    _ctrl_dirty: bool
    _snap: Control | None

    if TYPE_CHECKING:
        def observe(self, step: int, metrics: Mapping[str, Any] | None = None,
                    families: Mapping[str, Any] | None = None) -> Decision: ...

        def _track(self, s: int, vals: np.ndarray, present: np.ndarray
                   ) -> tuple[Intervention, ...]: ...

        def _finish_step(self, s: int, rows: list[tuple[_Binding, Any, Any]] | None,
                         gnow: float | None, tivs: tuple[Intervention, ...],
                         skipped: tuple[str, ...]) -> Decision: ...

    def replay(self, data: Any) -> list[Decision]:
        """Replay a recorded run: identical to a loop of :meth:`observe`, much faster.

        ``data``: a pyarrow ``Table`` / ``RecordBatch``, a pandas / polars ``DataFrame``, a dict
        of NumPy columns (``step`` plus one column per metric; nulls / masked / ``None`` = not
        logged; see :func:`stability.monitor_io.table_columns`), or an iterable of those
        (see :meth:`replay_batches`).  Non-numeric columns are ignored.
        """
        if is_table(data):
            return self._replay_table(data)
        return list(self.replay_batches(data))

    def replay_batches(self, batches: Iterable[Any]) -> Iterator[Decision]:
        """Replay batch after batch (bounded memory); detector state carries across batches."""
        for batch in batches:
            yield from self._replay_table(batch)

    def bind_table(self, data: Any) -> tuple[Any, dict[str, tuple[Any, Any]]]:
        """Bind a whole table the way :meth:`replay` does, without running any detector.

        Returns the steps and, per binding name, the ``(T, n_inputs, n_series)`` values and
        missing mask that replay feeds to that binding's detector -- the one binder shared by
        replay and offline tuning (:func:`replay.tuning.score_table`), so tuned thresholds
        reproduce online exactly.  Steps must be strictly increasing.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [{"name": "g", "detector": "ewma_z",
        ...                               "inputs": ["grad_norm/*"]}]})
        >>> steps, bound = mon.bind_table({"step": [0, 1], "grad_norm/a": [1.0, 2.0],
        ...                                "grad_norm/b": [3.0, 4.0]})
        >>> bound["g"][0].shape, bound["g"][0][1, 0].tolist()
        ((2, 1, 2), [2.0, 4.0])
        """
        steps, vals, pres = self._table_slots(*table_columns(data))
        if np.any(np.diff(steps) <= 0):
            raise ValueError("bind_table: steps must be strictly increasing.")
        out: dict[str, tuple[Any, Any]] = {}
        for b in self._bindings:
            idx = b.slot_index()
            out[b.name] = (vals[:, idx], ~pres[:, idx])
        return np.asarray(steps, dtype=np.int64), out

    def _table_slots(self, steps: Any, cols: list[tuple[str, Any, Any]]
                     ) -> tuple[Any, Any, Any]:
        """Steps, slot values ``(T, n_slots)`` and presence of decoded table columns (names
        bound in the order they first appear, as a live run would)."""
        firsts = []
        for ci, (_, _, p) in enumerate(cols):
            nz = np.flatnonzero(p)
            if nz.size:
                firsts.append((int(nz[0]), ci))
        for _, ci in sorted(firsts):
            self._lookup(cols[ci][0])
        if self._dirty:
            self._relayout()
        t_len, n_slots = len(steps), len(self._slot_names)
        vals = np.zeros((t_len, n_slots))
        pres = np.zeros((t_len, n_slots), dtype=np.bool_)
        for name, v, p in cols:
            s = self._cache.get(name, _SCRATCH)
            if s > _SCRATCH:
                vals[p, s] = v[p]
                pres[p, s] |= True
        return steps, vals, pres

    def _replay_table(self, data: Any) -> list[Decision]:
        steps, cols = table_columns(data)
        t_len = len(steps)
        if t_len == 0:
            return []
        if (steps[0] <= self.last_step or steps[0] < 0 or np.any(np.diff(steps) <= 0)
                or steps[-1] > MAX_STEP):
            return [self.observe(int(steps[t]), {n: float(v[t]) for n, v, p in cols if p[t]})
                    for t in range(t_len)]
        steps, vals, pres = self._table_slots(steps, cols)
        outs = []
        any_alarm = np.zeros(t_len, dtype=np.bool_)
        for b in self._bindings:
            idx = b.slot_index()
            x = vals[:, idx]
            sc, al = b.det.update_many(*[x[:, j, :] for j in range(b.n_inputs)],
                                       missing=~pres[:, idx])
            any_alarm |= al.any(axis=1)
            outs.append((sc, al))
        g = self._grad_slot
        bindings = self._bindings
        finish = self._finish_step
        decisions = []
        for t in range(t_len):
            s = int(steps[t])
            if self._ctrl_dirty:
                self.control.reset_step()
                self._ctrl_dirty = False
                self._snap = None
            gnow = float(vals[t, g]) if g and pres[t, g] else None
            self.last_step = s
            tivs = self._track(s, vals[t], pres[t])
            rows = ([(b, o[0][t], o[1][t]) for b, o in zip(bindings, outs, strict=True)]
                    if any_alarm[t] else None)
            decisions.append(finish(s, rows, gnow, tivs, ()))
        return decisions
