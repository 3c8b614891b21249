"""The decisions of a replay as a lazy sequence (what :meth:`Monitor.replay` returns).

A replay of a long run decides nothing on most steps; their decisions are built only when read,
from the step and the :class:`~stability.types.Control` snapshot in force -- the same objects a
loop of :meth:`~stability.monitor.monitor.Monitor.observe` returns.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from stability.types import Control, Decision

__all__ = ["Decisions"]


class Decisions(Sequence[Decision]):
    """The decisions of a replay, one per step, in step order (a read-only sequence).

    Decisions with alarms, interventions or skipped values are kept; those of quiet steps are
    built when read (they share the :class:`~stability.types.Control` snapshot in force, as in
    a live ``observe()`` loop).  Compares equal to a list of the same decisions.

    >>> from stability import Monitor
    >>> d = Monitor().replay({"step": [0, 1, 2], "loss": [1.0, 1.0, float("nan")]})
    >>> len(d), d[0].healthy, [a.kind for a in d[-1].alarms]
    (3, True, ['nonfinite'])
    >>> [e.step for e in d.events()]
    [2]
    """

    __slots__ = ("_steps", "_explicit", "_starts", "_ctrls")

    def __init__(self, steps: np.ndarray, explicit: dict[int, Decision],
                 starts: list[int], ctrls: list[Control]) -> None:
        self._steps = steps
        self._explicit = explicit
        self._starts = starts  # quiet row i uses ctrls[bisect_right(starts, i) - 1]
        self._ctrls = ctrls

    @classmethod
    def from_list(cls, decisions: Sequence[Decision]) -> Decisions:
        """Wrap decisions already built (all kept)."""
        steps = np.array([d.step for d in decisions], dtype=np.int64)
        return cls(steps, dict(enumerate(decisions)), [], [])

    @classmethod
    def concat(cls, parts: Iterable[Decisions]) -> Decisions:
        """One sequence of several replays' decisions, in order."""
        steps, explicit, starts, ctrls = [], {}, [], []
        off = 0
        for p in parts:
            steps.append(p._steps)
            explicit.update({off + i: d for i, d in p._explicit.items()})
            starts += [off + i for i in p._starts]
            ctrls += p._ctrls
            off += len(p._steps)
        st = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
        return cls(st, explicit, starts, ctrls)

    def __len__(self) -> int:
        return len(self._steps)

    def _at(self, i: int) -> Decision:
        d = self._explicit.get(i)
        if d is None:
            ctrl = self._ctrls[bisect_right(self._starts, i) - 1]
            d = Decision(int(self._steps[i]), control=ctrl)
        return d

    @overload
    def __getitem__(self, i: int) -> Decision: ...

    @overload
    def __getitem__(self, i: slice) -> list[Decision]: ...

    def __getitem__(self, i: int | slice) -> Decision | list[Decision]:
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError("Decisions index out of range")
        return self._at(k)

    def __iter__(self) -> Iterator[Decision]:
        return (self._at(k) for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Iterable[Decision]) -> list[Decision]:
        return [*self, *other]

    def __radd__(self, other: Iterable[Decision]) -> list[Decision]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Decisions({len(self)} steps, {len(self.events())} with events)"

    @property
    def steps(self) -> np.ndarray:
        """The replayed steps (int64)."""
        return self._steps

    def events(self) -> list[Decision]:
        """The decisions with alarms, interventions or skipped values, in step order."""
        ex = self._explicit
        return [ex[i] for i in sorted(ex) if ex[i].alarms or ex[i].interventions
                or ex[i].skipped]
