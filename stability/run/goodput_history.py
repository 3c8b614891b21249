"""The goodput ledger's step history, with bulk runs of steps kept lazily.

:class:`~stability.run.goodput.GoodputTracker` keeps ``(step, cumulative productive time)`` for the
last :data:`~stability.run.goodput.HISTORY` counted steps (a rollback's recompute cost).  A replay
counts its quiet steps in bulk (:meth:`~stability.run.goodput.GoodputTracker.update_many`), tens of
thousands at a time, and the history is read only when a rollback is counted or a step is
marked skipped: :class:`BulkTail` holds those bulk runs (their last steps only) until then, so
a replay of quiet batches does not rebuild the 20,000 history tuples at every batch.  Drained
into the history (in order, before anything reads or appends to it), they give the deque of
the step-by-step loop.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

__all__ = ["BulkTail"]


class BulkTail:
    """Runs of steps counted in bulk, not yet in the history deque: ``(steps, cum)`` each (the
    run's last ``maxlen`` steps, copied; the cumulative time, the same for the whole run).
    Runs wholly out of the last ``maxlen`` steps are dropped as new ones come."""

    __slots__ = ("maxlen", "runs", "n")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.runs: collections.deque[tuple[Any, float]] = collections.deque()
        self.n = 0  # steps held

    def __bool__(self) -> bool:
        return self.n > 0

    def add(self, steps: Any, cum: float) -> None:
        """Hold ``steps`` (an array or list of the run's last steps, not referenced
        elsewhere) counted at the cumulative time ``cum``."""
        runs = self.runs
        runs.append((steps, cum))
        self.n += len(steps)
        while len(runs) > 1 and self.n - len(runs[0][0]) >= self.maxlen:
            self.n -= len(runs.popleft()[0])

    def drain(self, hist: collections.deque[tuple[int, float]]) -> None:
        """Append the runs held to ``hist`` (a deque of ``maxlen`` entries), oldest first,
        and forget them."""
        for steps, cum in self.runs:
            ints = steps.tolist() if hasattr(steps, "tolist") else steps
            hist.extend(zip(ints, itertools.repeat(cum, len(ints)), strict=True))
        self.clear()

    def clear(self) -> None:
        self.runs.clear()
        self.n = 0
