"""Follow a live job's logs and run the monitor on them: ``stability watch SOURCE...``.

For jobs you cannot modify: the watcher reads what the job already writes -- a JSONL / CSV
metrics file, a Megatron / DeepSpeed stdout log, a TensorBoard event directory, or the
recorder's ``part-*.parquet`` directory (local paths or :mod:`pyarrow.fs` URIs) -- as it grows,
and feeds each new step to the same :class:`~stability.monitor.monitor.Monitor` as a live run
(``observe`` per step), so alerts go to the configured sinks, the event log gets every alarm and
intervention, and optional *actions* run: a shell command per intervention kind and/or a control
file the trainer polls.  Several sources are one run: their rows are merged by step.

Reading (reuses the importers' parsers: :mod:`replay.importers.tabular` for JSONL/CSV values,
:mod:`replay.importers.megatron` for log lines, :mod:`replay.importers.tensorboard` for events,
:func:`replay.reader.read_run` for Parquet parts):

* text files are read from the last offset to the last complete line (a line still being
  written is left for the next poll; a JSONL line that already parses is taken);
* **rotation** (the path now names another file: new inode) -- the old file is drained through
  the descriptor still open on it, then the new file is read from its start;
* **truncation** (the file shrank, or the bytes just before the offset changed: a
  ``copytruncate`` that was already refilled) -- the file is read again from its start;
* TensorBoard directories are listed on every poll; every event file is tailed record by record
  (complete TFRecords only); Parquet part directories: each new part is read once.

Steps (the rule):

* rows of one step are merged (TensorBoard writes one event per scalar; a Megatron validation
  line repeats the iteration of the training line); a step is judged once a later step has been
  read, or when a poll brings nothing new (the data settled), or at the end of ``--once``;
* a row for a step that was already judged is **already seen** and skipped -- a re-read after a
  truncation or a rotation, a late row, the same step from another source (two ranks' logs, a
  JSONL and a rounded CSV of one job) -- unless *its own stream went back* (a step at or before
  the stream's previous one) and its values differ from the ones judged (for the last 4096
  steps, beyond a relative 1e-5 for the rounding of text formats): then the job **re-ran**
  that step (it was restarted from a checkpoint), and the monitor is rewound to just before it
  (:meth:`~stability.monitor.monitor.Monitor.rewind`: detector statistics kept, LR-jump state
  reset) and judges the new values.

State (``state=``): the monitor's :meth:`~stability.monitor.monitor.Monitor.state_dict`, every
source's
offsets and the unjudged rows, written atomically (an ``O_EXCL`` temporary file + ``os.replace``;
an existing file is replaced only if it is a JSON object) every ``save_every`` seconds and on
exit; loaded at start, so a restarted watcher neither re-warms its detectors nor judges a step
twice.  A save that fails (a full disk) is reported once and retried at the next save: the
watcher goes on.  A damaged state file is refused with "unusable watch state" (never a
traceback).

Survival: a source that is not a regular file (a FIFO, a device) is reported and not read (an
``open`` on a FIFO without a writer would block forever); a line that cannot be parsed (a stray
CR in a CSV row) is counted and skipped; hooks run concurrently and never hold up a poll
(:class:`~replay.watch_actions.HookRunner`); SIGTERM ends the loop within a poll slice (0.1 s),
kills the hooks still running (their process groups) and saves the state.

Known limits: a step the job logs only after a later step (more than one poll late) is dropped
as already seen; a Megatron ``OVERFLOW`` line read just before a watcher restart is not carried
into the next iteration line; a TensorBoard tensor summary whose plugin name was written in an
earlier poll's events is taken as a scalar when it holds one number; CSV exports from the W&B
UI (``<run> - metric`` headers) keep their prefixes; a single ``.parquet`` file does not grow and
is not watched (its part directory is).  Each file is read at most
:data:`replay.watch_sources.POLL_BYTES` per poll, so a long backlog is judged over several polls.

Actions (the watcher's "acting" section; the hook runner is in :mod:`replay.watch_actions`):
``hooks={"stop": "CMD", ...}`` runs ``CMD`` through the shell for every intervention of that type
(``"alarm"``: every alarm step; ``"any"``: every intervention) with ``STABILITY_STEP``,
``STABILITY_KIND``, ``STABILITY_REASON``, ``STABILITY_CAUSE`` and ``STABILITY_CONTROL`` (the control
as JSON) in its environment; a failing or hanging command is reported and never stops the
watcher.  ``control_file=`` gets the latest :class:`~stability.types.Control` as JSON (atomically)
whenever the monitor requests something, for a trainer that polls it.

Examples
--------
>>> import os, tempfile
>>> d = tempfile.mkdtemp()
>>> log = os.path.join(d, "metrics.jsonl")
>>> with open(log, "w") as fh:
...     for s in range(60):
...         loss = 40.0 if s == 50 else 2.0 + 0.01 * (s % 3)
...         _ = fh.write('{"step": %d, "loss": %r}\\n' % (s, loss))
>>> w = Watcher([log], "default", echo=None)
>>> decisions = w.run(once=True)
>>> sorted({a.step for d in decisions for a in d.alarms})
[50]
>>> w.steps_judged
60
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from replay.watch_actions import HOOK_KINDS, HookRunner, _atomic_write, parse_hooks
from replay.watch_actions import format_decision as format_decision
from replay.watch_sources import FORMATS, Row, detect_watch_format, make_source
from stability.types import Decision

__all__ = ["HOOK_KINDS", "STATE_VERSION", "Watcher", "detect_watch_format", "parse_hooks"]

logger = logging.getLogger("stability.watch")

STATE_VERSION = 1
#: steps whose judged values are remembered to tell a re-read from a re-run
MEMORY_STEPS = 4096
#: ... of which this many are kept in the state file
STATE_MEMORY_STEPS = 256


# ---------------------------------------------------------------------------- the watcher
class Watcher:
    """Follow ``sources`` and feed every new step to a monitor (see the module docstring).

    Parameters
    ----------
    sources
        Paths or URIs: JSONL / CSV / TSV files, Megatron / DeepSpeed logs, TensorBoard event
        files or directories, recorder part directories.  They may not exist yet.
    config
        Monitor config (preset name, path, dict, ``MonitorConfig``; ``None``: ``default``).
        Ignored when ``monitor`` is given.
    state
        State file (JSON): loaded at start when it exists, saved every ``save_every`` seconds
        and on exit.
    events
        Event log path (JSONL; appended to).
    hooks
        Intervention type (or ``alarm`` / ``any``) -> shell command (see :func:`parse_hooks`).
    control_file
        Where to write the latest :class:`~stability.types.Control` as JSON.
    format
        Force the format of every source (``jsonl``, ``csv``, ``megatron``, ``tensorboard``,
        ``parquet``); detected per source by default.
    step_column
        Step column of JSONL / CSV sources (default: the importers' candidates).
    monitor
        A ready :class:`~stability.monitor.monitor.Monitor` (its own sinks and event log).
    exporter
        Anything with ``update(decision)`` (e.g. a
        :class:`~stability.outputs.prometheus.PrometheusExporter`), called for every judged step.
    echo
        Called with one line per alarm / intervention step (default: ``print``; ``None``: quiet).
    hook_timeout
        Seconds a hook command may run.
    backlog
        ``"act"`` (default): what is already in the sources when a watcher starts without a
        saved state is acted on like new steps; ``"quiet"``: it only warms the monitor (and
        goes to the event log) -- no alert sinks, hooks or control file for history.
    """

    #: step whose stop ran the stop hook (a stop stands: the monitor repeats it every later
    #: step until the job is gone); ``None`` until then, again after a resume
    stop_hooked: int | None = None

    def __init__(self, sources: Sequence[str], config: Any = None, *, state: str | None = None,
                 events: str | None = None, hooks: Mapping[str, str] | None = None,
                 control_file: str | None = None, format: str | None = None,
                 step_column: str | None = None, monitor: Any = None, exporter: Any = None,
                 echo: Callable[[str], None] | None = print, save_every: float = 30.0,
                 hook_timeout: float = 60.0, backlog: str = "act") -> None:
        if not sources:
            raise ValueError("watch needs at least one source")
        if backlog not in ("act", "quiet"):
            raise ValueError(f"backlog must be 'act' or 'quiet'. Got {backlog!r} instead.")
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}. Got {format!r} instead.")
        if monitor is None:
            from stability.monitor.monitor import Monitor
            from stability.outputs.events import EventLog

            monitor = Monitor(config, event_log=EventLog(events) if events else None)
        self.monitor = monitor
        self.specs = [os.fspath(s) for s in sources]
        self.format, self.step_column = format, step_column
        self._sources: dict[str, Any] = {s: None for s in self.specs}
        self.state_path = state
        self.hooks = dict(hooks or {})
        for k in self.hooks:
            if k not in HOOK_KINDS:
                raise ValueError(f"unknown hook kind {k!r}; known: {', '.join(HOOK_KINDS)}")
        from stability.outputs.safe_files import check_replaceable, json_object

        for path in (control_file, state):  # ours to replace, or refused now (clear error)
            if path is not None:
                check_replaceable(path, json_object)
        self.control_file = control_file
        self.exporter = exporter
        self.echo = echo
        self.save_every = save_every
        self.hook_timeout = hook_timeout
        self.backlog = backlog
        self._muted = False
        self._polls = 0
        self._stop = False
        self._last_rows = 0
        self._in_backlog = True
        self._backlog_max = -1  # the last step of the backlog (backlog="quiet")
        self._state_loaded = False
        self.hw = -1  # highest step judged (or the step before a resume)
        self._pending: dict[int, dict[str, float]] = {}
        self._memory: collections.OrderedDict[int, dict[str, float]] = collections.OrderedDict()
        self._prev: dict[str, int] = {}
        self._last_control: dict[str, Any] | None = None
        self._bind_checked = False
        self._saved_at = time.monotonic()
        self.steps_judged = 0
        self.already_seen = 0
        self.resumes = 0
        self.hook_runs = 0
        self.hook_failures = 0
        self.hook_runner = HookRunner(hook_timeout, self._hook_failed)
        self.save_failures = 0
        self._loaded_sources: dict[str, Any] = {}
        if state is not None and os.path.exists(state):
            self._load(state)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted watcher needs (JSON-compatible; NaN allowed in values)."""
        mem = list(self._memory.items())[-STATE_MEMORY_STEPS:]
        sources = dict(self._loaded_sources)
        sources.update({s: src.state_dict() for s, src in self._sources.items()
                        if src is not None})
        return {"version": STATE_VERSION, "monitor": self.monitor.state_dict(),
                "sources": sources, "hw": self.hw,
                "pending": [[s, m] for s, m in sorted(self._pending.items())],
                "memory": [[s, m] for s, m in mem], "prev": dict(self._prev),
                "control": self._last_control,
                "counts": {"steps_judged": self.steps_judged, "already_seen": self.already_seen,
                           "resumes": self.resumes},
                "stop_hooked": self.stop_hooked}

    def save(self) -> None:
        """Write the state file now (atomically); no-op without ``state``.

        A failure (a full disk, a read-only directory) is reported once and retried at the
        next save: the watcher goes on.
        """
        if self.state_path is None:
            return
        self._saved_at = time.monotonic()
        try:
            _atomic_write(self.state_path, json.dumps(self.state_dict()))
        except OSError as exc:
            self.save_failures += 1
            if self.save_failures == 1:
                logger.warning("cannot save the watch state to %s (%s); the watcher goes on "
                               "and retries at the next save (reported once)", self.state_path,
                               exc)

    def _load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as fh:
                st = json.load(fh)
            if not isinstance(st, dict) or st.get("version") != STATE_VERSION:
                raise ValueError("not a watch state file (or from another version)")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.monitor.load_state_dict(st["monitor"], strict=False)
            for w in caught:
                logger.warning("%s: %s", path, w.message)
            self.hw = int(st.get("hw", -1))
            self._pending = {int(s): dict(m) for s, m in st.get("pending", [])}
            self._memory = collections.OrderedDict(
                (int(s), dict(m)) for s, m in st.get("memory", []))
            self._prev = {str(k): int(v) for k, v in st.get("prev", {}).items()}
            self._last_control = st.get("control")
            self._loaded_sources = dict(st.get("sources", {}))
            self._state_loaded = True
            c = st.get("counts", {})
            self.steps_judged = int(c.get("steps_judged", 0))
            self.already_seen = int(c.get("already_seen", 0))
            self.resumes = int(c.get("resumes", 0))
            sh = st.get("stop_hooked")
            self.stop_hooked = None if sh is None else int(sh)
            for spec, saved in self._loaded_sources.items():
                self._check_source_state(spec, saved)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError,
                RecursionError) as exc:
            raise ValueError(f"{path}: unusable watch state ({type(exc).__name__}: {exc}); "
                             "move it away to start afresh") from None

    def _check_source_state(self, spec: str, saved: Any) -> None:
        """A saved source state loads into a fresh source of that spec (else ``ValueError``)."""
        if not isinstance(saved, dict):
            raise ValueError(f"source {spec!r}: a {type(saved).__name__}, not a mapping")
        src = make_source(spec, self.format, self.step_column)
        if src is not None:
            try:
                src.load_state_dict(saved)
            finally:
                src.close()

    # ------------------------------------------------------------------ reading
    def _source(self, spec: str) -> Any:
        src = self._sources[spec]
        if src is None:
            src = make_source(spec, self.format, self.step_column)
            if src is not None:
                saved = self._loaded_sources.pop(spec, None)
                if saved is not None:
                    src.load_state_dict(saved)
                self._sources[spec] = src
        return src

    def poll(self) -> list[Decision]:
        """Read every source once, judge what is ready; returns the new decisions."""
        self.hook_runner.reap()
        rows: list[Row] = []
        for spec in self.specs:
            src = self._source(spec)
            if src is not None:
                rows.extend(src.poll())
        self._polls += 1
        self._last_rows = len(rows)
        # backlog="quiet": the steps a fresh watcher finds at start (up to the first poll that
        # reads every file to its end) warm the monitor and act on nothing
        if self._in_backlog and self.backlog == "quiet" and not self._state_loaded:
            self._backlog_max = max([self._backlog_max] + [r[1] for r in rows])
        if not any(getattr(src, "more", False) for src in self._sources.values()):
            self._in_backlog = False  # caught up: later polls bring new steps
        out = self._take(rows)
        # a step is ready once a later one was read; everything is, when nothing new came
        out += self._release(everything=not rows)
        if out and not self._bind_checked:
            self._check_binding(out)
        return out

    def flush(self) -> list[Decision]:
        """Judge every step read so far (the end of ``--once``)."""
        out = self._release(everything=True)
        if out and not self._bind_checked:
            self._check_binding(out)
        return out

    @contextlib.contextmanager
    def _muting(self, mute: bool) -> Iterator[None]:
        """No alert sinks, hooks or control file while ``mute`` (the event log still records)."""
        if not mute:
            yield
            return
        sinks, self.monitor.alert_sinks = self.monitor.alert_sinks, []
        self._muted = True
        try:
            yield
        finally:
            self.monitor.alert_sinks = sinks
            self._muted = False

    def _check_binding(self, judged: Sequence[Decision]) -> None:
        """Warn once when no metric bound to a detector (names seen + closest known ones)."""
        from replay.replay import unbound_warning

        self._bind_checked = True
        names: dict[str, None] = {}
        for m in list(self._memory.values())[-len(judged):]:
            names.update(dict.fromkeys(m))
        note = unbound_warning(self.monitor, names)
        if note is not None:
            warnings.warn(f"{', '.join(self.specs)}: {note}", UserWarning, stacklevel=3)

    def _take(self, rows: Iterable[Row]) -> list[Decision]:
        out: list[Decision] = []
        for stream, step, metrics in rows:
            prev = self._prev.get(stream)
            self._prev[stream] = step
            if prev is not None and step < prev and self._pending:
                out += self._release(everything=True)  # the stream went back: settle first
            if step <= self.hw:
                old = self._memory.get(step)
                went_back = prev is not None and step <= prev  # this stream, not another
                if old is None or not went_back or not _differs(old, metrics):
                    self.already_seen += 1
                    continue
                out += self._release(everything=True)
                self._resume(step)
            self._pending.setdefault(step, {}).update(metrics)
        return out

    def _resume(self, step: int) -> None:
        """The job re-ran ``step`` (restarted from a checkpoint): judge from there again."""
        self.resumes += 1
        self.stop_hooked = None  # the job came back: a new stop is news
        self._backlog_max = min(self._backlog_max, step - 1)  # a re-run is news
        self.monitor.rewind(step - 1)
        self.hw = step - 1
        for s in [s for s in self._memory if s >= step]:
            del self._memory[s]
        if self.echo is not None:
            self.echo(f"step {step}: the job re-ran steps it had logged (restarted from a "
                      f"checkpoint?); monitor rewound to step {step - 1}")

    def _release(self, everything: bool) -> list[Decision]:
        if not self._pending:
            return []
        steps = sorted(self._pending)
        if not everything:
            steps = steps[:-1]
        out = []
        for s in steps:
            metrics = self._pending.pop(s)
            with self._muting(s <= self._backlog_max):
                d = self.monitor.observe(s, metrics)
                self._handle(d)
            self.hw = max(self.hw, s)
            self._memory[s] = metrics
            self._memory.move_to_end(s)
            while len(self._memory) > MEMORY_STEPS:
                self._memory.popitem(last=False)
            self.steps_judged += 1
            out.append(d)
        return out

    # ------------------------------------------------------------------ acting
    # (echo, exporter, control file, hooks)
    def _handle(self, d: Decision) -> None:
        if self.exporter is not None:
            try:
                self.exporter.update(d)
            except Exception as exc:  # metrics must not stop the watcher
                logger.warning("exporter update failed: %s: %s", type(exc).__name__, exc)
        if not (d.alarms or d.interventions):
            return
        if self.echo is not None:
            self.echo(format_decision(d) + (" [backlog: no action]" if self._muted else ""))
        if self._muted:
            return
        if self.control_file is not None:
            ctrl = d.control.to_dict()
            if d.interventions or ctrl != self._last_control:
                self._write_control(d)
        if self.hooks:
            if d.alarms and "alarm" in self.hooks:
                a = d.alarms[0]
                self._run_hook("alarm", d, a.kind, a.message or f"{a.kind} on {a.signal}", "")
            for iv in d.interventions:
                cmd_kind = iv.type if iv.type in self.hooks else "any"
                if cmd_kind not in self.hooks or self._repeated_stop(iv.type, d.step):
                    continue
                self._run_hook(cmd_kind, d, iv.type, iv.reason, getattr(iv, "cause", ""))

    def _repeated_stop(self, kind: str, step: int) -> bool:
        """Whether this is a stop after the one whose hook already ran (hooks fire once per
        intervention: the stop the monitor keeps asking for on the steps the job still logs
        is the same one)."""
        if kind != "stop":
            return False
        if self.stop_hooked is not None and step > self.stop_hooked:
            return True
        self.stop_hooked = step
        return False

    def _write_control(self, d: Decision) -> None:
        ctrl = d.control.to_dict()
        doc = {"step": d.step, "time": time.time(), "control": ctrl,
               "interventions": [i.to_dict() for i in d.interventions],
               "alarms": sorted({a.kind for a in d.alarms})}
        try:
            _atomic_write(self.control_file, json.dumps(doc))  # type: ignore[arg-type]
            self._last_control = ctrl
        except (OSError, ValueError) as exc:  # a full disk; a foreign file put there since
            logger.warning("cannot write the control file %s: %s", self.control_file, exc)

    def _run_hook(self, hook: str, d: Decision, kind: str, reason: str, cause: str) -> None:
        env = dict(os.environ, STABILITY_STEP=str(d.step), STABILITY_KIND=kind,
                   STABILITY_REASON=reason, STABILITY_CAUSE=cause,
                   STABILITY_CONTROL=json.dumps(d.control.to_dict()))
        self.hook_runs += 1
        self.hook_runner.start(f"hook {hook} (step {d.step})", self.hooks[hook], env)

    def _hook_failed(self, label: str, message: str) -> None:
        self.hook_failures += 1
        logger.warning("%s %s", label, message)

    # ------------------------------------------------------------------ loop
    def run(self, once: bool = False, poll: float = 5.0, max_polls: int | None = None,
            collect: bool = True) -> list[Decision]:
        """Follow the sources until interrupted (``once``: one pass, then judge everything).

        Returns the decisions made (all of them with ``once``; with a live loop only those
        with alarms or interventions, to bound memory; none with ``collect=False``).  The
        state is saved on the way out, also on ``KeyboardInterrupt``; :meth:`stop` (the CLI's
        SIGTERM / SIGINT handler) ends the loop between polls, so no row read is lost.
        """
        out: list[Decision] = []
        n = 0
        try:
            while not self._stop:
                ds = self.poll()
                n += 1
                if once:
                    if collect:
                        out += ds
                    if (self._last_rows or self._more()) and not self._stop:
                        continue  # a long backlog (maybe of non-metric lines): read to EOF
                    ds = self.flush()
                    out += ds if collect else []
                    break
                if collect:
                    out += [d for d in ds if d.alarms or d.interventions]
                if self.state_path and time.monotonic() - self._saved_at >= self.save_every:
                    self.save()
                if max_polls is not None and n >= max_polls:
                    break
                wake = time.monotonic() + poll
                while not self._stop and time.monotonic() < wake:
                    time.sleep(min(0.1, poll))
        except KeyboardInterrupt:
            self._stop = True
        finally:
            if self._stop:
                self.hook_runner.cancel()  # SIGTERM: never wait for a hook
            else:
                self.hook_runner.finish(self.hook_timeout)
            self.save()
            ev = getattr(self.monitor, "event_log", None)
            if ev is not None:
                ev.flush()
        return out

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current poll (safe from a signal handler); the
        hooks still running are killed on the way out."""
        self._stop = True

    def _more(self) -> bool:
        """Some source stopped at its byte budget: bytes remain to read."""
        return any(getattr(src, "more", False) for src in self._sources.values())

    def close(self) -> None:
        """Close the files held open."""
        for src in self._sources.values():
            if src is not None:
                src.close()

    def summary(self) -> str:
        """One line: steps judged, already seen, resumes, alarms, last step."""
        c = self.monitor.counters
        return (f"{self.steps_judged} steps judged (last {self.hw}), {self.already_seen} rows "
                f"already seen, {self.resumes} resumes, {c['alarms']} alarms on "
                f"{c['alarm_steps']} steps, {c['interventions']} interventions")


#: relative difference under which two values of one metric are the same (text formats round:
#: ``%.6g`` in a CSV)
SAME_REL = 1e-5


def _differs(old: Mapping[str, float], new: Mapping[str, float]) -> bool:
    """Some metric both rows hold has another value (NaN equals NaN; values within a relative
    :data:`SAME_REL` are equal).

    >>> _differs({"loss": 2.3456789}, {"loss": 2.34568}), _differs({"loss": 2.0}, {"loss": 2.5})
    (False, True)
    """
    for k, v in new.items():
        o = old.get(k)
        if o is None:
            continue
        if math.isnan(o) or math.isnan(v):
            if math.isnan(o) and math.isnan(v):
                continue
            return True
        if not (o == v or math.isclose(o, v, rel_tol=SAME_REL)):
            return True
    return False
