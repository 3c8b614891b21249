"""Batch replay of a recorded run through the monitor (the replay half of
:class:`stability.monitor.monitor.Monitor`, a mixin).

The table is decoded column by column straight from its buffers (Arrow tables are read by duck
typing: float64 data as zero-copy views, validity bitmaps unpacked into present masks; the
runtime never imports pyarrow), then processed in chunks of rows: each bank gets its
``(rows, n_inputs, n_series)`` input in one copy per value and runs its batch kernel once per
chunk.  The per-step tail (alarms, policy, goodput, decision, event log) is
:meth:`Monitor._finish_step`, the same method :meth:`~stability.monitor.monitor.Monitor.observe`
ends
with, so a replay gives the decisions of a step-by-step ``observe()`` loop bit for bit.  Steps
on which nothing happens -- no alarm, no policy in force, no LR/loss to follow -- skip that tail:
they are counted in bulk (goodput ledger, counters, gradient history) and their decisions are
built only when read (:class:`Decisions`).  The chunk loop and the tail are
:mod:`stability.monitor.replay_run`'s; a stream of tables (:meth:`ReplayMixin.replay_stream`)
keeps its chunk blocks from table to table.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from stability.monitor.decisions import Decisions
from stability.monitor.io import _ARROW_NUMERIC, is_table, table_columns
from stability.monitor.layout import _SCRATCH, MAX_STEP, LayoutMixin, _Binding
from stability.monitor.replay_fill import fill_bank as _fill_bank
from stability.monitor.replay_run import Replay, ReplayBlocks
from stability.types import Control, Decision, Intervention

__all__ = ["Decisions", "ReplayMixin"]

#: values per replay chunk (rows per chunk = this / bound signals, at least 1024): the banks'
#: inputs and outputs of one chunk stay in cache and memory stays bounded on long runs
CHUNK_VALUES = 1 << 20

#: a decoded column: float64 values (a read-only view where possible; undefined where not
#: present) and the present mask (``None``: present on every row)
_Column = tuple[np.ndarray, "np.ndarray | None"]


# ---------------------------------------------------------------------------- decoding
def _arrow_array(arr: Any) -> _Column:
    """Values and present mask of one Arrow array (duck-typed; float64 data zero-copy)."""
    n = len(arr)
    if n == 0:
        return np.zeros(0), None
    if str(arr.type) != "double":
        arr = arr.cast("float64")
    bufs = arr.buffers()
    off = int(arr.offset)
    vals = np.frombuffer(bufs[1], dtype=np.float64, count=off + n)[off:]
    if not arr.null_count:
        return vals, None
    bits = np.unpackbits(np.frombuffer(bufs[0], dtype=np.uint8), count=off + n,
                         bitorder="little")[off:]
    return vals, bits.view(np.bool_)


def _arrow_column(col: Any) -> _Column:
    chunks = getattr(col, "chunks", None)
    if chunks is not None:  # a ChunkedArray (Table column)
        col = chunks[0] if len(chunks) == 1 else col.combine_chunks()
    return _arrow_array(col)


def _decode(data: Any) -> tuple[np.ndarray, list[tuple[str, _Column]]]:
    """``(steps, [(name, (values, present)), ...])`` of a table (see
    :func:`stability.monitor.io.table_columns` for what is accepted and what counts as missing).
    """
    if not (type(data).__module__.startswith("pyarrow") and hasattr(data, "column_names")):
        steps, cols = table_columns(data)
        return steps, [(n, (v, None if p.all() else p)) for n, v, p in cols]
    names = list(data.column_names)
    if "step" not in names:
        raise ValueError("replay: the table has no 'step' column.")
    scol = data.column(names.index("step"))
    if scol.null_count:
        raise ValueError("replay: the 'step' column contains nulls.")
    one = scol.chunk(0) if getattr(scol, "num_chunks", 0) == 1 else scol
    if str(scol.type) == "int64" and not hasattr(one, "num_chunks"):
        steps = one.to_numpy()  # a view: int64 steps need no check or conversion
    else:  # the step checks and conversions of table_columns, on the step column alone
        steps, _ = table_columns({"step": np.asarray(scol.to_numpy(zero_copy_only=False))})
    out = []
    for k, name in enumerate(names):
        if name == "step":
            continue
        col = data.column(k)
        if str(col.type) in _ARROW_NUMERIC:
            out.append((str(name), _arrow_column(col)))
    return steps, out


def _merge(a: _Column, b: _Column) -> _Column:
    """Two columns bound to one slot: ``b`` wins where present (as a later metric would)."""
    va, pa_ = a
    vb, pb = b
    if pb is None:
        return vb, None
    vals = np.where(pb, vb, va)
    return vals, (None if pa_ is None else pa_ | pb)


class ReplayMixin(LayoutMixin):
    """:meth:`replay`, :meth:`replay_batches`, :meth:`replay_stream` and :meth:`bind_table`."""

    last_step: int
    control: Control
    goodput: Any
    goodput_every: int
    event_log: Any
    _ctrl_dirty: bool
    _policy_dirty: bool
    _snap: Control | None
    _grad_hist: Any
    _grad_last: float | None
    _grad_slot: int
    _lr_slot: int
    _loss_slot: int
    _val_slot: int
    _lr_now: float | None
    _lr_prev: float | None
    policy: Any

    if TYPE_CHECKING:
        def observe(self, step: int, metrics: Mapping[str, Any] | None = None,
                    families: Mapping[str, Any] | None = None) -> Decision: ...

        def _track(self, s: int, vals: np.ndarray, present: np.ndarray
                   ) -> tuple[Intervention, ...]: ...

        def _finish_step(self, s: int, rows: list[tuple[_Binding, Any, Any]] | None,
                         gnow: float | None, tivs: tuple[Intervention, ...],
                         skipped: tuple[str, ...]) -> Decision: ...

        def _snapshot(self) -> Control: ...

        def _log_goodput(self) -> None: ...

    def replay(self, data: Any) -> Decisions:
        """Replay a recorded run: identical to a loop of :meth:`observe`, much faster.

        ``data``: a pyarrow ``Table`` / ``RecordBatch``, a pandas / polars ``DataFrame``, a dict
        of NumPy columns (``step`` plus one column per metric; nulls / masked / ``None`` = not
        logged; see :func:`stability.monitor.io.table_columns`), or an iterable of those
        (see :meth:`replay_batches`).  Non-numeric columns are ignored.

        Returns the :class:`Decisions`, one per row (a sequence; ``.events()`` lists those with
        alarms or interventions).
        """
        if is_table(data):
            return self._replay_table(data)
        return Decisions.concat(self.replay_stream(data))

    def replay_batches(self, batches: Iterable[Any]) -> Iterator[Decision]:
        """Replay batch after batch (bounded memory); detector state carries across batches."""
        for d in self.replay_stream(batches):
            yield from d

    def replay_stream(self, batches: Iterable[Any]) -> Iterator[Decisions]:
        """Replay batch after batch, one :class:`Decisions` per batch: the decisions of
        :meth:`replay` of the whole table, bit for bit, in bounded memory.

        Detector state carries across batches, and so do the replay's chunk blocks (the same
        pages, their constant parts written once), so a stream of batches of ~100K rows runs
        as fast as the whole table.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [{"name": "s", "detector": "ewma_z",
        ...                               "inputs": ["loss"]}]})
        >>> parts = [{"step": [0, 1], "loss": [1.0, 1.1]}, {"step": [2], "loss": [1.2]}]
        >>> [len(d) for d in mon.replay_stream(parts)]
        [2, 1]
        """
        blocks = ReplayBlocks()
        for batch in batches:
            out = self._replay_table(batch, blocks)
            del batch  # freed before the next batch is made
            yield out

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
        steps, cols = _decode(data)
        if np.any(np.diff(steps) <= 0):
            raise ValueError("bind_table: steps must be strictly increasing.")
        slotcol = self._bind_columns(cols)
        if self._dirty:
            self._relayout()
        t_len = len(steps)
        out: dict[str, tuple[Any, Any]] = {}
        for b in self._bindings:
            x = np.empty((t_len, b.n_inputs, len(b.keys)))
            m = np.empty(x.shape, dtype=np.bool_)
            _fill_bank(self._feeds(b, slotcol), x, m, 0, t_len)
            out[b.name] = (x, m)
        return np.asarray(steps, dtype=np.int64), out

    def bound_names(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` that feed a detector (binding them, as a replay would):
        the columns worth reading for a replay with this monitor's config.

        >>> from stability import Monitor
        >>> mon = Monitor({"detectors": [
        ...     {"name": "s", "detector": "ewma_z", "inputs": ["loss"]},
        ...     {"name": "g", "detector": "ewma_z", "inputs": ["grad_norm/*"]}]})
        >>> mon.bound_names(["train/loss", "epoch_time_s", "grad_norm/3"])
        ['train/loss', 'grad_norm/3']
        """
        return [n for n in names if self._lookup(n) > _SCRATCH]

    def _table_slots(self, steps: Any, cols: list[tuple[str, Any, Any]]
                     ) -> tuple[Any, Any, Any]:
        """Steps, slot values ``(T, n_slots)`` and presence of decoded table columns (names
        bound in the order they first appear, as a live run would)."""
        slotcol = self._bind_columns([(n, (v, p)) for n, v, p in cols])
        if self._dirty:
            self._relayout()
        t_len, n_slots = len(steps), len(self._slot_names)
        vals = np.zeros((t_len, n_slots))
        pres = np.zeros((t_len, n_slots), dtype=np.bool_)
        for s, (v, p) in slotcol.items():
            if p is None:
                vals[:, s] = v
                pres[:, s] = True
            else:
                vals[p, s] = v[p]
                pres[:, s] = p
        return steps, vals, pres

    def _bind_columns(self, cols: list[tuple[str, _Column]]) -> dict[int, _Column]:
        """Bind the columns' names in the order they first appear (as a live run would) and
        return the column of every bound slot."""
        firsts = []
        for ci, (_, (_, p)) in enumerate(cols):
            if p is None:
                if len(cols[ci][1][0]):
                    firsts.append((0, ci))
            elif p.any():
                firsts.append((int(p.argmax()), ci))
        for _, ci in sorted(firsts):
            self._lookup(cols[ci][0])
        slotcol: dict[int, _Column] = {}
        for name, col in cols:
            s = self._cache.get(name, _SCRATCH)
            if s > _SCRATCH:
                old = slotcol.get(s)
                slotcol[s] = col if old is None else _merge(old, col)
        return slotcol

    def _feeds(self, b: _Binding, slotcol: dict[int, _Column]
               ) -> list[tuple[int, int, _Column | None]]:
        return [(j, i, slotcol.get(s)) for j, row in enumerate(b.slots)
                for i, s in enumerate(row)]

    def _replay_table(self, data: Any, blocks: ReplayBlocks | None = None) -> Decisions:
        """One table; ``blocks``: the chunk blocks of a stream of tables (``None``: this
        table's own)."""
        steps, cols = _decode(data)
        t_len = len(steps)
        if t_len == 0:
            return Decisions.from_list([])
        if (steps[0] <= self.last_step or steps[0] < 0 or bool((steps[1:] <= steps[:-1]).any())
                or steps[-1] > MAX_STEP):
            return Decisions.from_list([
                self.observe(int(steps[t]), {n: float(v[t]) for n, (v, p) in cols
                                             if p is None or p[t]})
                for t in range(t_len)])
        slotcol = self._bind_columns(cols)
        if self._dirty:
            self._relayout()
        # no cyclic garbage is made here: a collection triggered by the bulk allocations (the
        # goodput history, decisions) would only scan the whole heap
        was = gc.isenabled()
        gc.disable()
        try:
            full = max(1024, CHUNK_VALUES // max(1, len(slotcol)))
            chunk = min(t_len, full)
            if blocks is None:  # one table: blocks of its own size
                return Replay(self, steps, slotcol, chunk, ReplayBlocks(), chunk).run()
            return Replay(self, steps, slotcol, chunk, blocks, full).run()
        finally:
            if was:
                gc.enable()
