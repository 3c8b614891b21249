"""Bank inputs of the replay's chunks (the batch path of
:meth:`stability.monitor.monitor.Monitor.replay`).

:func:`fill_bank` copies a chunk of the decoded columns into a bank's ``(rows, n_inputs,
n_series)`` input block and missing mask (one strided copy per input).  :class:`GuardChunks`
spares the non-finite guard (bound to every column by the presets) that copy on the usual
chunk, one whose present values are all finite: its scores, alarms and state then follow from
the present masks alone (:meth:`detectors.nonfinite.NonFiniteGuard.update_finite_many`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from detectors.nonfinite import NonFiniteGuard

#: a decoded column: float64 values (undefined where not present) and the present mask
#: (``None``: present on every row)
Column = tuple[np.ndarray, "np.ndarray | None"]
Feeds = list[tuple[int, int, "Column | None"]]


def fill_bank(feeds: Feeds, x: np.ndarray, m: np.ndarray, lo: int, hi: int,
              first: bool = True) -> None:
    """Rows ``[lo, hi)`` of a bank's input ``x`` and missing mask ``m`` (one copy per value).

    ``first=False``: ``x`` and ``m`` hold the previous chunk, so what does not change from
    chunk to chunk (absent inputs, masks of columns without nulls) is not written again.
    """
    for j, i, col in feeds:
        xc = x[:, j, i]
        mc = m[:, j, i]
        if col is None:
            if first:
                xc[:] = 0.0
                mc[:] = True
            continue
        v, p = col
        xc[:] = v[lo:hi]
        if p is None:
            if first:
                mc[:] = False
        else:
            np.logical_not(p[lo:hi], out=mc)
            xc[mc] = 0.0


def finite_chunks(feeds: Feeds, t_len: int, chunk: int) -> np.ndarray:
    """Per chunk of ``chunk`` rows: whether the present values of every column are all finite
    (their sum is finite: a NaN or an infinity makes it non-finite; a sum that overflows only
    says no).  One pass per column for all the chunks."""
    starts = np.arange(0, t_len, chunk)
    ok = np.ones(starts.size, dtype=np.bool_)
    with np.errstate(over="ignore", invalid="ignore"):
        for _, _, col in feeds:
            if col is None:
                continue
            v, p = col
            if p is not None:
                v = np.where(p, v, 0.0)
            ok &= np.isfinite(np.add.reduceat(v, starts))
    return ok


def feed_sig(feeds: Feeds) -> tuple[int, ...]:
    """What of a bank's input is constant from chunk to chunk: per feed 0 (absent), 1 (present
    on every row: an all-False mask) or 2 (a mask to copy)."""
    return tuple(0 if col is None else 1 if col[1] is None else 2 for _, _, col in feeds)


class Block:
    """A bank's input block and missing mask, and what their rows hold from earlier fills.

    ``sig`` / ``rows``: the first ``rows`` rows hold the constant parts (absent inputs, masks of
    columns without nulls) of feeds with this :func:`feed_sig`, so a fill of as many rows or
    fewer with the same signature does not write them again -- within a table and from table
    to table of a stream.
    """

    __slots__ = ("m", "rows", "sig", "x")

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.x = np.empty(shape)
        self.m = np.empty(shape, dtype=np.bool_)
        self.sig: tuple[int, ...] | None = None
        self.rows = 0

    def fill(self, feeds: Feeds, sig: tuple[int, ...], lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of the columns into the block's first ``hi - lo`` rows."""
        c = hi - lo
        first = sig != self.sig or c > self.rows
        fill_bank(feeds, self.x[:c], self.m[:c], lo, hi, first)
        if first:
            self.sig, self.rows = sig, c


class GuardChunks:
    """A one-input non-finite guard bank through the chunks: its kernel on its filled input
    where a chunk holds a non-finite value, the present masks alone elsewhere.

    Kept across the tables of a stream (:meth:`table` per table): the constant score / alarm
    columns written for one chunk are not written again while the present masks keep their
    kind (:func:`feed_sig`).
    """

    def __init__(self, block: Block) -> None:
        self.block = block
        self.det: Any = None
        self.feeds: Feeds = []
        self.chunk = 1
        self.ok = np.zeros(0, dtype=np.bool_)
        self.sig: tuple[int, ...] = ()
        # the constant score / alarm columns of the first ``wrows`` rows hold the values of
        # feeds with signature ``wsig`` (None: not written)
        self.wsig: tuple[int, ...] | None = None
        self.wrows = 0

    @staticmethod
    def applies(det: Any, n_inputs: int) -> bool:
        return type(det) is NonFiniteGuard and n_inputs == 1

    def table(self, det: Any, feeds: Feeds, t_len: int, chunk: int) -> None:
        """Start a table of ``t_len`` rows in chunks of ``chunk``."""
        self.det = det
        self.feeds = feeds
        self.chunk = chunk
        self.ok = finite_chunks(feeds, t_len, chunk)
        self.sig = feed_sig(feeds)

    def run(self, sc: np.ndarray, al: np.ndarray, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` into ``sc`` / ``al`` (``(hi - lo, n)`` views of the bank's
        output blocks)."""
        feeds = self.feeds
        c = hi - lo
        if self.ok[lo // self.chunk]:
            present: list[Any] = [False] * len(feeds)
            for _, i, col in feeds:
                if col is not None:
                    present[i] = True if col[1] is None else col[1][lo:hi]
            written = self.sig == self.wsig and c <= self.wrows
            self.det.update_finite_many(present, sc, al, written)
            if not written:
                self.wsig, self.wrows = self.sig, c
            return
        blk = self.block
        blk.fill(feeds, self.sig, lo, hi)
        self.wsig = None
        self.det.update_many_array(blk.x[:c], blk.m[:c], sc, al)
