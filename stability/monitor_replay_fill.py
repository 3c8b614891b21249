"""Bank inputs of the replay's chunks (the batch path of
:class:`stability.monitor_replay.ReplayMixin`).

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


class GuardChunks:
    """A one-input non-finite guard bank through the chunks: its kernel on its filled input
    where a chunk holds a non-finite value, the present masks alone elsewhere."""

    def __init__(self, det: Any, feeds: Feeds, t_len: int, chunk: int) -> None:
        self.det = det
        self.feeds = feeds
        self.chunk = chunk
        self.ok = finite_chunks(feeds, t_len, chunk)
        self.filled = False  # x / m hold an earlier chunk (fill_bank's first=False)
        self.written = False  # the constant score / alarm columns hold their values

    @staticmethod
    def applies(det: Any, n_inputs: int) -> bool:
        return type(det) is NonFiniteGuard and n_inputs == 1

    def run(self, x: np.ndarray, m: np.ndarray, sc: np.ndarray, al: np.ndarray, lo: int,
            hi: int) -> None:
        """Rows ``[lo, hi)`` into ``sc`` / ``al`` (``(hi - lo, n)`` views of the bank's
        output blocks; ``x`` / ``m``: its input blocks)."""
        feeds = self.feeds
        if self.ok[lo // self.chunk]:
            present: list[Any] = [False] * len(feeds)
            for _, i, col in feeds:
                if col is not None:
                    present[i] = True if col[1] is None else col[1][lo:hi]
            self.det.update_finite_many(present, sc, al, self.written)
            self.written = True
            return
        x, m = x[:hi - lo], m[:hi - lo]
        fill_bank(feeds, x, m, lo, hi, not self.filled)
        self.filled = True
        self.written = False
        self.det.update_many_array(x, m, sc, al)
