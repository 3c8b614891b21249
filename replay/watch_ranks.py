"""Which rank is the culprit, from an unmodified job's per-rank logs: ``stability watch --ranks``.

The in-process path (:mod:`stability.adapters.distributed`) gathers each rank's local signals
into a ``(world, k)`` matrix every step and feeds it to
:class:`~stability.ranks.ranks.RankMonitor`.  A job that cannot be modified still writes per-rank
lines; :class:`RankWatcher` builds the same matrix from them and feeds the *same*
:class:`~stability.ranks.ranks.RankMonitor`, so the rules (robust z against the other ranks,
non-finite on some ranks only, persistence of slow steps, the health ledger) are one.

Sources (local paths or :mod:`pyarrow.fs` URIs, followed like ``stability watch`` follows a
log: rotation and truncation survive, a line still being written waits):

* **several files, one per rank** (``rank3.jsonl``, ``log_rank_3.txt``, ``node1-rank3.out``): the
  rank is the number after ``rank`` in the file name, else the file's position;
* **one combined log** whose lines carry the rank: torchrun's ``[rank3]:`` (``[default3]:`` in
  older versions), ``srun --label``'s ``3:``, OpenMPI ``--tag-output``'s ``[1,3]<stdout>:``.

Each line (after the prefix) is a JSON object, a Megatron / DeepSpeed line (the importer's
parser: ``iteration N/M | lm loss: ... | grad norm: ...``) or ``key=value`` / ``key: value``
pairs with a step key (``step=120 loss=2.31 grad_norm=0.8``).  Names go through the monitor's
alias table.  Per rank and step the matrix row holds (``nan`` where the log has nothing):

* ``loss``, ``grad_norm``: as logged by that rank (a rank's *local* value: a job that logs the
  all-reduced norm on every rank shows the same value everywhere and nothing to attribute);
* ``step_time``: a logged duration (``step_time``, ``iter_time_s``, ``iter_time_ms``, Megatron's
  ``elapsed time per iteration (ms)``), else the difference of the line times per logged step;
  line times are a logged epoch (``time``, ``timestamp``) or a leading ``YYYY-MM-DD HH:MM:SS``
  (read as UTC: only differences between lines count);
* ``data_wait``: ``data_wait`` / ``data_time`` when logged.

Steps: a step is judged when every rank has logged it, or once the job has logged
:data:`SETTLE_STEPS` later steps (a rank still missing then is *absent* that step: neither
judged nor counted, see ``present`` in :meth:`~stability.ranks.ranks.RankMonitor.observe`).

Stalls: a rank is **stalled** when another rank has logged a later step and the rank has been
silent for more than ``stall_after`` seconds: while following live, on the watcher's clock (time
since its last new line was read); at the end of ``--once`` (a post-mortem), on the log's clock:
how long the other ranks went on after the step it stopped at (their line times; each rank's
own clock, so skew between hosts does not count).  One ``rank_stall`` alarm per episode names
the rank, its host, its last step and the time since its last line; a new line ends the episode.

Examples
--------
>>> split_rank("[rank3]: iteration 10/ 100 | lm loss: 2.5 |")
(3, 'iteration 10/ 100 | lm loss: 2.5 |')
>>> split_rank("1: step=4 loss=nan")
(1, 'step=4 loss=nan')
>>> rank_from_name("logs/node0-rank12.jsonl", 0), rank_from_name("b.log", 5)
(12, 5)
>>> p = LineParser("r0")
>>> p.parse('2024-05-01 12:00:01,500 INFO step=7 loss=2.5 grad_norm=0.9 iter_time_ms=250')
(7, {'loss': 2.5, 'grad_norm': 0.9, 'step_time': 0.25}, 1714564801.5)
"""

from __future__ import annotations

import collections
import datetime as _dt
import functools
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.importers.megatron import _Parser as _MegatronParser
from replay.importers.tabular import STEP_CANDIDATES, _parse_number
from replay.schema import alias_resolver
from replay.watch_sources import _split_lines, _Tail
from stability.monitor.binding import DEFAULT_ALIASES
from stability.ranks.outliers import RANK_SIGNALS
from stability.ranks.ranks import RankMonitor
from stability.types import Alarm

__all__ = ["SETTLE_STEPS", "LineParser", "RankWatcher", "rank_from_name", "split_rank"]

#: later steps logged by the job after which a step is judged without the ranks still missing
SETTLE_STEPS = 3

_PREFIX = re.compile(r"^\s*(?:\[(?:rank|default)(\d+)\]:|\[\d+,(\d+)\]<std(?:out|err)>:|(\d+):\s)")
_NAME_RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:[.,](\d+))?")
_PAIR = re.compile(r"(?<![\w/.-])([A-Za-z_][\w/.-]*)\s*[=:]\s*"
                   r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity))"
                   r"(?![\w.])", re.IGNORECASE)
_MEGATRON = re.compile(r"\biteration\s+\d+\s*/\s*\d+\s*\||\bsteps:\s*\d+\s+loss:")

#: line times kept per rank (to measure a stall from the step a rank stopped at)
TIMES_KEPT = 4096

#: logged durations -> (rank signal, factor to seconds)
DURATIONS: dict[str, tuple[str, float]] = {
    "step_time": ("step_time", 1.0), "iter_time_s": ("step_time", 1.0),
    "iter_time": ("step_time", 1.0), "iter_time_ms": ("step_time", 1e-3),
    "step_time_ms": ("step_time", 1e-3), "time_per_step": ("step_time", 1.0),
    "data_wait": ("data_wait", 1.0), "data_time": ("data_wait", 1.0),
    "data_wait_ms": ("data_wait", 1e-3), "data_time_ms": ("data_wait", 1e-3),
}
#: logged epoch times (seconds; milliseconds beyond 1e12)
TIMES = ("time", "timestamp", "_timestamp", "wall_time")


def split_rank(line: str) -> tuple[int | None, str]:
    """``(rank, rest)`` of a line with a launcher's rank prefix; ``(None, line)`` without."""
    m = _PREFIX.match(line)
    if m is None:
        return None, line
    rank = next(g for g in m.groups() if g is not None)
    return int(rank), line[m.end():].strip()


def rank_from_name(path: str, index: int) -> int:
    """The rank a per-rank file's name says (``...rank3...``), else ``index``."""
    m = _NAME_RANK.search(path.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else index


def _epoch(v: float) -> float:
    return v / 1000.0 if v > 1e12 else v


def _line_time(text: str) -> float | None:
    m = _TIMESTAMP.search(text[:64])
    if m is None:
        return None
    frac = m.group(3) or "0"
    try:
        t = _dt.datetime.fromisoformat(f"{m.group(1)} {m.group(2)}").replace(
            tzinfo=_dt.timezone.utc)  # only differences count: the zone does not matter
    except ValueError:
        return None
    return t.timestamp() + float(f"0.{frac}")


class LineParser:
    """One rank's lines -> ``(step, signals, line time)``; ``None`` for a line without a step.

    ``signals`` holds canonical names (``loss``, ``grad_norm``, ``step_time``, ``data_wait``,
    other logged metrics too); ``line time`` is an epoch in seconds or ``None``.
    """

    def __init__(self, source: str) -> None:
        self.megatron = _MegatronParser(source, strict=False)
        self.canon = alias_resolver(DEFAULT_ALIASES)

    def parse(self, text: str) -> tuple[int, dict[str, float], float | None] | None:
        """Parse one line (without its rank prefix)."""
        raw = self._fields(text)
        if raw is None:
            return None
        step, values = raw
        out: dict[str, float] = {}
        when = _line_time(text)
        for k, v in values.items():
            name = self.canon(k)
            if name in TIMES:
                when = _epoch(v)
            elif name in DURATIONS:
                sig, factor = DURATIONS[name]
                out[sig] = v * factor
            else:
                out[name] = v
        return step, out, when

    def _fields(self, text: str) -> tuple[int, dict[str, float]] | None:
        body = text.strip()
        if _MEGATRON.search(body):
            rows = list(self.megatron.parse([body]))
            if rows:
                step, row = rows[-1]
                return step, {k: float(v) for k, v in row.items() if v is not None}
        start = body.find("{")
        if start >= 0 and body.endswith("}"):
            got = _json_fields(body[start:])
            if got is not None:
                return got
        return _pair_fields(body)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    return _parse_number(v) if isinstance(v, str) else None


def _with_step(values: dict[str, float]) -> tuple[int, dict[str, float]] | None:
    key = next((c for c in STEP_CANDIDATES if c in values), None)
    if key is None:
        return None
    step = values.pop(key)
    if not math.isfinite(step) or step < 0 or step != int(step):
        return None
    return int(step), values


def _json_fields(text: str) -> tuple[int, dict[str, float]] | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    vals = {str(k): f for k, v in obj.items() if (f := _number(v)) is not None}
    return _with_step(vals)


def _pair_fields(text: str) -> tuple[int, dict[str, float]] | None:
    vals = {k: float(v) for k, v in _PAIR.findall(text)}
    return _with_step(vals) if vals else None


# ---------------------------------------------------------------------------- per-rank state
@dataclass
class _Rank:
    """What one rank's log has said so far."""

    last_step: int = -1
    last_time: float | None = None  #: line time of its last step (log clock)
    seen_at: float = 0.0  #: watcher clock when its last new step was read
    prev: tuple[int, float] | None = None  #: (step, line time) for step-time differences
    stalled: bool = False
    late_rows: int = 0
    times: collections.OrderedDict[int, float] = field(default_factory=collections.OrderedDict)
    rows: dict[int, dict[str, float]] = field(default_factory=dict)


class RankWatcher:
    """Follow per-rank logs; name the culprit rank (see the module docstring).

    Parameters
    ----------
    sources
        One file per rank, or one combined log with rank prefixes.
    hosts
        Host name per rank (default: none; alarms say ``rank 3``).
    world
        World size (default: the number of per-rank files, or the highest rank seen in a
        combined log plus one, fixed at the first poll that reads any line).
    stall_after
        Seconds of silence (while another rank logs later steps) that make a rank stalled.
    events
        Event log (JSONL, appended): every alarm and the ``rank_health`` records whose status
        changed (``stability ranks EVENTS`` renders them).
    echo
        Called with one line per alarm (``None``: quiet).
    clock
        The watcher's clock (seconds; default :func:`time.monotonic`).
    monitor_args
        Keyword arguments of :class:`~stability.ranks.ranks.RankMonitor` (``threshold``, ...).
    """

    def __init__(self, sources: Sequence[str], *, hosts: Sequence[str] | None = None,
                 world: int | None = None, stall_after: float = 60.0,
                 events: str | None = None, echo: Callable[[str], None] | None = print,
                 clock: Callable[[], float] = time.monotonic,
                 monitor_args: Mapping[str, Any] | None = None) -> None:
        if not sources:
            raise ValueError("watch --ranks needs at least one source")
        if not (isinstance(stall_after, (int, float)) and stall_after > 0):
            raise ValueError("The 'stall_after' parameter of RankWatcher must be a number of "
                             f"seconds > 0. Got {stall_after!r} instead.")
        self.specs = [os.fspath(s) for s in sources]
        self.combined = len(self.specs) == 1
        self.file_rank = {s: rank_from_name(s, i) for i, s in enumerate(self.specs)}
        if not self.combined and len(set(self.file_rank.values())) != len(self.specs):
            self.file_rank = {s: i for i, s in enumerate(self.specs)}  # names do not tell
        self.tails = {s: _Tail(s) for s in self.specs}
        self.parsers: dict[int, LineParser] = {}
        self.hosts = list(hosts) if hosts else None
        self.world = world if world is not None else (
            None if self.combined else max(self.file_rank.values()) + 1)
        self.stall_after = float(stall_after)
        self.echo, self.clock = echo, clock
        self.monitor_args = dict(monitor_args or {})
        self.monitor: RankMonitor | None = None
        self.ranks: dict[int, _Rank] = {}
        self.judged = -1  #: highest step judged
        self.steps_judged = 0
        self.alarms: list[Alarm] = []
        self.first_line: float | None = None  #: watcher clock at the job's first line
        self.event_log: Any = None
        if events:
            from stability.outputs.events import EventLog

            self.event_log = EventLog(events)

    # ------------------------------------------------------------------ reading
    def _consume(self, spec: str, data: bytes, reset: bool, final: bool) -> int:
        lines, used = _split_lines(data, final, lambda line: False)
        now = self.clock()
        for raw in lines:
            text = raw.decode("utf-8", errors="replace")
            rank, rest = split_rank(text)
            if not self.combined:
                rank = self.file_rank[spec]
            if rank is not None:
                self._line(rank, rest, now)
        return used

    def _line(self, rank: int, text: str, now: float) -> None:
        parser = self.parsers.setdefault(rank, LineParser(f"rank {rank}"))
        got = parser.parse(text)
        if got is None:
            return
        step, values, when = got
        if self.first_line is None:
            self.first_line = now
        r = self.ranks.setdefault(rank, _Rank(seen_at=now))
        if step <= self.judged:
            r.late_rows += 1
            return
        if "step_time" not in values and when is not None and r.prev is not None \
                and step > r.prev[0]:
            values["step_time"] = (when - r.prev[1]) / (step - r.prev[0])
        if when is not None:
            r.prev = (step, when)
            r.times[step] = when
            while len(r.times) > TIMES_KEPT:
                r.times.popitem(last=False)
        r.rows.setdefault(step, {}).update(values)
        if step > r.last_step:
            r.last_step, r.last_time, r.seen_at = step, when, now
            if r.stalled:
                r.stalled = False
                self._say(f"rank {rank}: logging again (step {step})")

    def poll(self) -> list[Alarm]:
        """Read every source once; judge the settled steps; check for stalls."""
        for spec, tail in self.tails.items():
            tail.poll(functools.partial(self._consume, spec))
        out = self._judge(everything=False)
        out += self._stalls(live=True)
        return out

    def flush(self) -> list[Alarm]:
        """Judge every step read so far (the end of ``--once``) and check for stalls on the
        log's clock."""
        return self._judge(everything=True) + self._stalls(live=False)

    # ------------------------------------------------------------------ judging
    def _ensure_monitor(self) -> RankMonitor | None:
        if self.monitor is None and self.ranks:
            world = self.world or max(self.ranks) + 1
            self.world = world
            hosts = self.hosts or [""] * world
            if len(hosts) != world:
                raise ValueError(f"--hosts names {len(hosts)} hosts for {world} ranks")
            self.monitor = RankMonitor(hosts, **self.monitor_args)
        return self.monitor

    def _ready_steps(self, everything: bool) -> list[int]:
        steps = sorted({s for r in self.ranks.values() for s in r.rows})
        if everything:
            return steps
        world = self.world or 0
        out = []
        for i, s in enumerate(steps):
            have = sum(s in r.rows for k, r in self.ranks.items() if k < world)
            if have < world and len(steps) - 1 - i < SETTLE_STEPS:
                break
            out.append(s)
        return out

    def _judge(self, everything: bool) -> list[Alarm]:
        mon = self._ensure_monitor()
        if mon is None:
            return []
        out: list[Alarm] = []
        for s in self._ready_steps(everything):
            m = np.full((mon.world_size, len(RANK_SIGNALS)), np.nan)
            present = np.zeros(mon.world_size, dtype=bool)
            for k, r in self.ranks.items():
                row = r.rows.pop(s, None)
                if row is None or k >= mon.world_size:
                    continue
                present[k] = True
                m[k] = [row.get(sig, math.nan) for sig in RANK_SIGNALS]
                m[k, RANK_SIGNALS.index("nonfinite")] = 0.0
            alarms = list(mon.observe(s, m, present))
            self.judged, self.steps_judged = max(self.judged, s), self.steps_judged + 1
            self._record(s, alarms, mon.changes)
            out += alarms
        return out

    # ------------------------------------------------------------------ stalls
    def _silence(self, r: _Rank, now: float, live: bool) -> float | None:
        """Seconds since ``r``'s last line: on the watcher's clock while following live, else
        on the log's (``None``: the lines carry no times)."""
        if live:
            return now - r.seen_at
        spans = [o.last_time - o.times[r.last_step] for o in self.ranks.values()
                 if o is not r and o.last_time is not None and r.last_step in o.times]
        if not spans and r.last_time is not None:  # the others never logged its last step
            spans = [o.last_time - r.last_time for o in self.ranks.values()
                     if o.last_time is not None]
        return max(spans) if spans else None

    def _stalls(self, live: bool) -> list[Alarm]:
        mon = self._ensure_monitor()
        if mon is None:
            return []
        now = self.clock()
        for k in range(mon.world_size):  # a rank that never logged: silent since the job's
            self.ranks.setdefault(k, _Rank(seen_at=self.first_line or now))  # first line
        top = max(r.last_step for r in self.ranks.values())
        out = []
        for k, r in sorted(self.ranks.items()):
            if r.stalled or k >= mon.world_size or r.last_step >= top:
                continue
            quiet = self._silence(r, now, live)
            if quiet is None or quiet <= self.stall_after:
                continue
            r.stalled = True
            last = f"last line at step {r.last_step}" if r.last_step >= 0 else "no line yet"
            msg = (f"{mon.where(k)} stalled: no line for {quiet:.1f} s ({last}; other ranks "
                   f"at step {top})")
            a = Alarm(top, "rank_stall", f"rank{k}/stall", float(quiet), self.stall_after,
                      "critical", "rank_stall", msg)
            self._record(top, [a], [])
            out.append(a)
        return out

    # ------------------------------------------------------------------ output
    def _say(self, line: str) -> None:
        if self.echo is not None:
            self.echo(line)

    def _record(self, step: int, alarms: Sequence[Alarm], changes: Sequence[Any]) -> None:
        self.alarms += alarms
        for a in alarms:
            self._say(f"step {step}: {a.message}")
            if self.event_log is not None:
                self.event_log.alarm(a)
        if self.event_log is not None:
            for rec in changes:
                self.event_log.append(rec)

    def run(self, once: bool = False, poll: float = 5.0, max_polls: int | None = None,
            until: Callable[[], bool] | None = None) -> list[Alarm]:
        """Poll until interrupted, ``max_polls`` polls, or ``until()`` is true (``once``: read
        everything there is, judge it, return).  Returns every alarm raised."""
        n = 0
        try:
            while True:
                self.poll()
                n += 1
                if once:
                    if any(t.more for t in self.tails.values()):
                        continue
                    self.flush()
                    break
                if (max_polls is not None and n >= max_polls) or (until and until()):
                    break
                time.sleep(poll)
        except KeyboardInterrupt:
            pass
        finally:
            if self.event_log is not None:
                self.event_log.flush()
        return list(self.alarms)

    def close(self) -> None:
        """Close the files held open (and the event log)."""
        for t in self.tails.values():
            t.close()
        if self.event_log is not None:
            self.event_log.close()

    def accused(self) -> dict[int, list[str]]:
        """Rank -> the signals it was named on (``stall`` included), from every alarm."""
        out: dict[int, list[str]] = {}
        for a in self.alarms:
            rank, _, sig = a.signal.partition("/")
            out.setdefault(int(rank[4:]), [])
            if sig not in out[int(rank[4:])]:
                out[int(rank[4:])].append(sig)
        return out

    def summary(self) -> str:
        """One line: steps judged, ranks, alarms, the ranks named."""
        named = "; ".join(f"rank {k}: {', '.join(v)}" for k, v in sorted(self.accused().items()))
        return (f"{self.steps_judged} steps judged over {self.world or 0} ranks (last "
                f"{self.judged}), {len(self.alarms)} rank alarms" + (f"; named {named}"
                                                                       if named else ""))
