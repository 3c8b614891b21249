"""One table through the monitor's banks and per-step tail (the engine of
:meth:`stability.monitor.monitor.Monitor.replay`, see :mod:`stability.monitor.replay`).

:class:`Replay` runs the bank kernels chunk by chunk over one decoded table, then the per-step
tail.  The banks' chunk blocks (inputs, missing masks, scores, alarms) live in a
:class:`ReplayBlocks`, which a stream of tables (:meth:`~stability.monitor.monitor.Monitor.replay`
of
an iterable of batches, :meth:`~stability.monitor.monitor.Monitor.replay_batches`) keeps from table
to
table: the blocks stay in the same pages, and what does not change from chunk to chunk (absent
inputs, masks of columns without nulls, the non-finite guard's constant columns) is not written
again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from stability.monitor.decisions import Decisions
from stability.monitor.replay_fill import Block, Column, Feeds, GuardChunks, feed_sig
from stability.types import Control, Decision

if TYPE_CHECKING:
    from stability.monitor.layout import Binding
    from stability.monitor.monitor import Monitor

__all__ = ["Decided", "Replay", "ReplayBlocks"]


class Decided:
    """The decisions of one replayed table, and the quiet steps not yet counted."""

    def __init__(self, mon: Monitor, steps: np.ndarray) -> None:
        self.mon = mon
        self.steps = steps
        self.explicit: dict[int, Decision] = {}
        self.starts: list[int] = []
        self.ctrls: list[Control] = []
        self.pending: list[list[Any]] = []  # [first row, end row, control snapshot]

    def quiet(self, a: int, b: int, snap: Control) -> None:
        if not self.ctrls or self.ctrls[-1] is not snap:
            self.starts.append(a)
            self.ctrls.append(snap)
        pend = self.pending
        if pend and pend[-1][1] == a and pend[-1][2] is snap:
            pend[-1][1] = b
        else:
            pend.append([a, b, snap])

    def flush(self) -> None:
        """Count the pending quiet steps (goodput ledger, step counter, goodput records)."""
        mon = self.mon
        counters = mon.counters
        every = mon.goodput_every if mon.event_log is not None else 0
        for a, b, snap in self.pending:
            c0 = counters["steps"]
            start = a
            if every:
                k = every - c0 % every
                while a + k <= b:
                    self._count(start, a + k, snap)
                    counters["steps"] = c0 + k
                    mon._log_goodput()
                    start = a + k
                    k += every
            self._count(start, b, snap)
            counters["steps"] = c0 + (b - a)
        self.pending = []

    def _count(self, a: int, b: int, snap: Control) -> None:
        if b <= a:
            return
        gp = self.mon.goodput
        if snap.rollback_to is not None:
            for s in self.steps[a:b].tolist():
                gp.update_from_control(s, snap)
            return
        gp.update_many(self.steps[a:b], skipped=snap.skip_step,
                       degraded=snap.lr_factor < 1.0 or snap.clip_norm is not None)

    def result(self) -> Decisions:
        self.flush()
        return Decisions(self.steps, self.explicit, self.starts, self.ctrls)


class ReplayBlocks:
    """The banks' chunk blocks for one layout: per binding ``(binding, guard, input block,
    fills it, scores, alarms)``.  Banks fed by the same slots in the same places share one
    input :class:`~stability.monitor.replay_fill.Block`, filled once per chunk by the first of
    them (kernels do not write their inputs); the non-finite guard has its own
    (:class:`~stability.monitor.replay_fill.GuardChunks`)."""

    def __init__(self) -> None:
        self.layout: Any = None  # the monitor's gather plan the blocks were made for
        self.rows = 0
        self.banks: list[tuple[Any, GuardChunks | None, Block, bool, np.ndarray,
                               np.ndarray]] = []
        self.tv = np.zeros((0, 0))
        self.tp = np.zeros((0, 0), dtype=np.bool_)

    def track_block(self, mon: Monitor, chunk: int,
                    tracked: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The ``(slots, chunk)`` values / present block of the tracked slots (LR, loss,
        validation loss), kept across the tables of a stream (~9 MB on a wide run: made once,
        not faulted in at every batch); the rows of the slots not in ``tracked`` read absent."""
        k = max(mon._lr_slot, mon._loss_slot, mon._val_slot) + 1
        tv, tp = self.tv, self.tp
        if tv.shape[0] != k or tv.shape[1] < chunk:
            self.tv = tv = np.zeros((k, chunk))
            self.tp = tp = np.zeros((k, chunk), dtype=np.bool_)
        else:
            for s in (mon._lr_slot, mon._loss_slot, mon._val_slot):
                if s and s not in tracked:
                    tp[s] = False
        return tv, tp

    def get(self, mon: Monitor, chunk: int, rows: int) -> list[Any]:
        """The banks' blocks for chunks of ``chunk`` rows (made anew, of ``rows >= chunk``
        rows, when the layout changed or they are too short)."""
        if self.layout is not mon._gather or chunk > self.rows:
            blocks: dict[Any, Block] = {}
            banks = []
            for b in mon._bindings:
                n = len(b.keys)
                shape = (rows, b.n_inputs, n)
                guard: GuardChunks | None = None
                if GuardChunks.applies(b.det, b.n_inputs):
                    blk, fill = Block(shape), False
                    guard = GuardChunks(blk)
                else:
                    key = (shape, tuple(tuple(r) for r in b.slots))
                    fill = key not in blocks
                    if fill:
                        blocks[key] = Block(shape)
                    blk = blocks[key]
                banks.append((b, guard, blk, fill, np.empty((rows, n)),
                              np.empty((rows, n), dtype=np.bool_)))
            self.layout, self.rows, self.banks = mon._gather, rows, banks
        return self.banks


class Replay:
    """One table through the monitor: bank kernels chunk by chunk, then the per-step tail.

    ``chunk``: rows per chunk; ``blocks``: the banks' blocks (kept across the tables of a
    stream), made anew with ``rows`` rows when too short.
    """

    def __init__(self, mon: Monitor, steps: np.ndarray, slotcol: dict[int, Column],
                 chunk: int, blocks: ReplayBlocks, rows: int) -> None:
        self.mon = mon
        self.steps = steps
        self.slotcol = slotcol
        self.out = Decided(mon, steps)
        t_len = len(steps)
        self.chunk = chunk
        self.blocks = blocks
        self.rows = max(rows, chunk)
        g = mon._grad_slot
        self.grad = slotcol.get(g) if g else None
        tracked = [s for s in (mon._lr_slot, mon._loss_slot, mon._val_slot)
                   if s and s in slotcol]
        self.tracked = tracked
        need = None
        if tracked:
            need = np.zeros(t_len, dtype=np.bool_)
            for s in tracked:
                p = slotcol[s][1]
                if p is None:
                    need[:] = True
                    break
                need |= p
        self.need = need
        # the tracked slots as rows of a (slots, chunk) block: _track reads column r of it
        self.tv, self.tp = blocks.track_block(mon, self.chunk, tracked)

    def run(self) -> Decisions:
        mon = self.mon
        t_len = len(self.steps)
        banks = []
        for b, guard, blk, fill, sc, al in self.blocks.get(mon, self.chunk, self.rows):
            feeds: Feeds = mon._feeds(b, self.slotcol)
            if guard is not None:
                guard.table(b.det, feeds, t_len, self.chunk)
            banks.append((b, feeds, guard, blk, feed_sig(feeds) if fill else None, sc, al))
        for lo in range(0, t_len, self.chunk):
            hi = min(lo + self.chunk, t_len)
            c = hi - lo
            alarm = np.zeros(c, dtype=np.bool_)
            outs = []
            for b, feeds, guard, blk, sig, sc, al in banks:
                sc, al = sc[:c], al[:c]
                outs.append((b, sc, al))
                if not feeds:
                    continue
                if guard is not None:  # the non-finite guard: no input copy on finite chunks
                    guard.run(sc, al, lo, hi)
                else:
                    if sig is not None:
                        blk.fill(feeds, sig, lo, hi)
                    b.det.update_many_array(blk.x[:c], blk.m[:c], sc, al)
                if al.any():  # a flat test; the rows only when some series alarmed
                    alarm[np.flatnonzero(al.reshape(-1)) // al.shape[1]] = True
            self._tail(lo, hi, alarm, outs)
        for _, _, guard, *_ in banks:
            if guard is not None:  # no reference to this table's columns once replayed:
                guard.feeds = []   # the next batch is read into their pages
        return self.out.result()

    def _quiet_bulk(self, a: int, b: int) -> None:
        """Rows ``[a, b)``: no alarm, nothing to follow, no policy in force."""
        mon = self.mon
        mon.last_step = int(self.steps[b - 1])
        if self.grad is not None:
            v, p = self.grad
            g = v[a:b] if p is None else v[a:b][p[a:b]]
            g = g[np.isfinite(g)]
            if g.size:
                hist = mon._grad_hist
                hist.extend(g[-(hist.maxlen or g.size):].tolist())
                mon._grad_last = float(g[-1])
        self.out.quiet(a, b, mon._snapshot())

    def _track_bulk(self, a: int, b: int) -> int:
        """Follow the LR, loss and validation loss of rows ``[a, b)`` (no alarm on them) in
        bulk (:meth:`~stability.policy.policy.Policy.track_many`); returns the rows taken."""
        mon = self.mon
        cols: list[tuple[np.ndarray, np.ndarray] | None] = []
        for s in (mon._lr_slot, mon._loss_slot, mon._val_slot):
            col = self.slotcol.get(s) if s else None
            if col is None:
                cols.append(None)
            else:
                v, p = col
                cols.append((v[a:b], np.ones(b - a, dtype=np.bool_) if p is None else p[a:b]))
        k = int(mon.policy.track_many(self.steps[a:b], *cols))
        lr = cols[0]
        if k and lr is not None:  # the monitor's own record of the last two requested LRs
            seen = lr[0][:k][lr[1][:k]]
            if seen.size:
                mon._lr_prev = float(seen[-2]) if seen.size > 1 else mon._lr_now
                mon._lr_now = float(seen[-1])
        return k

    def _tail(self, lo: int, hi: int, alarm: np.ndarray,
              outs: list[tuple[Binding, np.ndarray, np.ndarray]]) -> None:
        mon = self.mon
        c = hi - lo
        need = self.need
        tv, tp = self.tv, self.tp
        if need is not None:
            need = need[lo:hi]
            for s in self.tracked:
                v, p = self.slotcol[s]
                tv[s, :c] = v[lo:hi]
                tp[s, :c] = True if p is None else p[lo:hi]
        ev = np.flatnonzero(alarm).tolist()
        n_ev = len(ev)
        steps = self.steps
        grad = self.grad
        hist = mon._grad_hist
        out = self.out
        finish = mon._finish_step
        track = mon._track
        k = 0
        r = 0
        while r < c:
            if not (mon._policy_dirty or mon._ctrl_dirty):
                while k < n_ev and ev[k] < r:
                    k += 1
                e = ev[k] if k < n_ev else c
                if e > r:
                    if need is not None:  # the LR / loss to follow, in bulk while nothing happens
                        e = r + self._track_bulk(lo + r, lo + e)
                    if e > r:
                        self._quiet_bulk(lo + r, lo + e)
                        r = e
                        continue
            t = lo + r
            s = int(steps[t])
            if mon._ctrl_dirty:
                mon.control.reset_step()
                mon._ctrl_dirty = False
                mon._snap = None
            gnow = None
            if grad is not None and (grad[1] is None or grad[1][t]):
                gnow = float(grad[0][t])
            mon.last_step = s
            tivs = track(s, tv[:, r], tp[:, r]) if need is not None and need[r] else ()
            if alarm[r] or tivs or mon._policy_dirty:
                out.flush()
                rows = [(b, sc[r], al[r]) for b, sc, al in outs] if alarm[r] else None
                out.explicit[t] = finish(s, rows, gnow, tivs, ())
            else:
                if gnow is not None and math.isfinite(gnow):
                    hist.append(gnow)
                    mon._grad_last = gnow
                out.quiet(t, t + 1, mon._snapshot())
            r += 1
