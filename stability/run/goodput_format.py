"""Text rendering of the goodput ledger (``stability goodput EVENTS``).

:func:`format_goodput` turns the last ``goodput`` record of an event log into the badput
breakdown the CLI prints.  Re-exported by :mod:`stability.run.goodput`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def _hms(s: float) -> str:
    s = float(s)
    if 0 < s < 1:
        return f"{1000 * s:.1f}ms"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def format_goodput(records: Iterable[Mapping[str, Any]], width: int = 30) -> str:
    """The badput breakdown of an event log, as text (``stability goodput EVENTS``).

    Uses the last ``goodput`` record (the ledger is cumulative, across restarts too) and counts
    ``stall`` records.

    Examples
    --------
    >>> from stability.run.goodput import GoodputTracker
    >>> g = GoodputTracker(clock=iter([0.0, 10.0, 20.0, 35.0]).__next__)
    >>> g.start(); g.update(1); g.note_checkpoint(5.0); g.update(2); g.update(3)
    >>> print(format_goodput([g.record()]))  # doctest: +NORMALIZE_WHITESPACE
    goodput at step 3: 100.0% of steps productive (3 of 3), 85.7% of wall time
    wall time 35.0s (1 checkpoints, 0 restarts, 0 rollbacks, 0 stalls)
      productive        30.0s   85.7%  ##########################
      skipped            0.0s    0.0%
      rollback           0.0s    0.0%
      checkpoint         5.0s   14.3%  ####
      restart            0.0s    0.0%
      stall              0.0s    0.0%
      other              0.0s    0.0%
    """
    from stability.run.goodput import TIME_BUCKETS

    last: Mapping[str, Any] | None = None
    n_stalls = 0
    for r in records:
        if r.get("type") == "goodput":
            last = r
        elif r.get("type") == "stall":
            n_stalls += 1
    if last is None:
        return "no goodput records (log GoodputTracker.record() to the event log)"
    steps = int(last.get("steps", 0) or 0)
    prod = int(last.get("productive", 0) or 0)
    gp = last.get("goodput")
    head = (f"goodput at step {last.get('step')}: "
            + (f"{100 * float(gp):.1f}% of steps productive ({prod} of {steps})"
               if gp is not None else "no steps"))
    times = last.get("time_s")
    wall = float(last.get("wall_time_s", 0.0) or 0.0)
    if not isinstance(times, Mapping) or wall <= 0:
        return head
    lines = [head + f", {100 * times.get('productive', 0.0) / wall:.1f}% of wall time",
             f"wall time {_hms(wall)} ({last.get('checkpoints', 0)} checkpoints, "
             f"{last.get('restarts', 0)} restarts, {last.get('rollbacks', 0)} rollbacks, "
             f"{max(int(last.get('stalls', 0) or 0), n_stalls)} stalls)"]
    for name in TIME_BUCKETS:
        v = float(times.get(name, 0.0) or 0.0)
        frac = v / wall
        bar = "#" * int(round(frac * width))
        lines.append(f"  {name:<12} {_hms(v):>9} {100 * frac:6.1f}%  {bar}".rstrip())
    return "\n".join(lines)
