"""Follow a live job's logs and run the monitor on them: ``stability watch SOURCE...``.

For jobs you cannot modify: the watcher reads what the job already writes -- a JSONL / CSV
metrics file, a Megatron / DeepSpeed stdout log, a TensorBoard event directory, or the
recorder's ``part-*.parquet`` directory (local paths or :mod:`pyarrow.fs` URIs) -- as it grows,
and feeds each new step to the same :class:`~stability.monitor.Monitor` as a live run
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
  truncation or a rotation, a late row -- unless its values differ from the ones judged (for the
  last 4096 steps): then the job **re-ran** that step (it was restarted from a checkpoint), and
  the monitor is rewound to just before it (:meth:`~stability.monitor.Monitor.rewind`: detector
  statistics kept, LR-jump state reset) and judges the new values.

State (``state=``): the monitor's :meth:`~stability.monitor.Monitor.state_dict`, every source's
offsets and the unjudged rows, written atomically (temporary file + ``os.replace``) every
``save_every`` seconds and on exit; loaded at start, so a restarted watcher neither re-warms its
detectors nor judges a step twice.

Known limits: a step the job logs only after a later step (more than one poll late) is dropped
as already seen; a Megatron ``OVERFLOW`` line read just before a watcher restart is not carried
into the next iteration line; a TensorBoard tensor summary whose plugin name was written in an
earlier poll's events is taken as a scalar when it holds one number; CSV exports from the W&B
UI (``<run> - metric`` headers) keep their prefixes; a single ``.parquet`` file does not grow and
is not watched (its part directory is).  Each file is read at most :data:`POLL_BYTES` per poll,
so a long backlog is judged over several polls.

Actions: ``hooks={"stop": "CMD", ...}`` runs ``CMD`` through the shell for every intervention of
that type (``"alarm"``: every alarm step; ``"any"``: every intervention) with ``STABILITY_STEP``,
``STABILITY_KIND``, ``STABILITY_REASON``, ``STABILITY_CAUSE`` and ``STABILITY_CONTROL`` (the
control as JSON) in its environment; a failing or hanging command is reported and never stops
the watcher.  ``control_file=`` gets the latest :class:`~stability.types.Control` as JSON
(atomically) whenever the monitor requests something, for a trainer that polls it.

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

import base64
import collections
import contextlib
import csv
import functools
import json
import logging
import math
import os
import re
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.importers._stream import BLANK
from replay.importers.megatron import _Parser as _MegatronParser
from replay.importers.tabular import STEP_CANDIDATES, _flat_row, _parse_number
from replay.importers.tensorboard import _event_files, iter_scalars, masked_crc32c
from replay.schema import RunFormatError
from stability.types import INTERVENTION_TYPES, Decision

__all__ = ["HOOK_KINDS", "STATE_VERSION", "Watcher", "detect_watch_format", "parse_hooks"]

logger = logging.getLogger("stability.watch")

STATE_VERSION = 1
#: hook names: intervention types plus ``alarm`` (every alarm step) and ``any`` (every
#: intervention)
HOOK_KINDS = tuple(sorted(INTERVENTION_TYPES)) + ("alarm", "any")
#: steps whose judged values are remembered to tell a re-read from a re-run
MEMORY_STEPS = 4096
#: ... of which this many are kept in the state file
STATE_MEMORY_STEPS = 256
#: bytes read from one file per poll (a long backlog is read over several polls)
POLL_BYTES = 64 << 20
_BLOCK = 4 << 20
_MAX_BLOCK = 64 << 20
_SIG = 64  # bytes before the offset that must not change between polls
_PART = re.compile(r"^part-(\d+)\.parquet$")
_FORMATS = ("jsonl", "csv", "megatron", "tensorboard", "parquet")

Row = tuple[str, int, dict[str, float]]  # (stream, step, metrics)


# ---------------------------------------------------------------------------- format
def detect_watch_format(path: str) -> str | None:
    """The watch format of ``path`` (``None`` while it cannot be told: not there yet).

    >>> detect_watch_format("logs/train.jsonl"), detect_watch_format("job.out")
    ('jsonl', 'megatron')
    """
    base = path.rstrip("/").rsplit("/", 1)[-1].lower()
    if "tfevents" in base:
        return "tensorboard"
    if base.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if base.endswith((".csv", ".tsv")):
        return "csv"
    if base.endswith((".log", ".out", ".err", ".txt")):
        return "megatron"
    info = _info(path)
    if info is None:
        return None
    fs, inner, typ = info
    if typ == pafs.FileType.Directory:
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(inner, recursive=True))]
        if any(_PART.match(n) for n in names):
            return "parquet"
        if any("tfevents" in n for n in names):
            return "tensorboard"
        return None  # empty so far
    from replay.io import detect_format

    fmt = detect_format(path)
    return {"json": "jsonl", "hf_trainer": "jsonl"}.get(fmt, fmt)


def _info(path: str) -> tuple[pafs.FileSystem, str, pafs.FileType] | None:
    if is_uri(path):
        fs, inner = pafs.FileSystem.from_uri(path)
    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(path)
    typ = fs.get_file_info(inner).type
    return None if typ == pafs.FileType.NotFound else (fs, inner, typ)


# ---------------------------------------------------------------------------- byte tailing
Consumer = Callable[[bytes, bool, bool], int]


class _Tail:
    """Tail one file (local or URI): new bytes go to ``consume(data, reset, final)``, which
    returns how many it used (``reset``: the data starts a new or truncated file; ``final``: no
    more bytes follow for now)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.uri = is_uri(path)
        self.offset = 0
        self.ident: tuple[int, int] | None = None
        self.sig = b""
        self.fd: int | None = None
        self.replaced = 0  # rotations + truncations seen
        self._fresh = True  # the next data starts at byte 0 of a file
        self.budget = POLL_BYTES
        self.more = False  # the last poll stopped at the byte budget

    # -- state
    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "ident": list(self.ident) if self.ident else None,
                "sig": base64.b64encode(self.sig).decode(), "replaced": self.replaced}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.offset = int(d.get("offset", 0))
        ident = d.get("ident")
        self.ident = (int(ident[0]), int(ident[1])) if ident else None
        self.sig = base64.b64decode(d.get("sig", ""))
        self.replaced = int(d.get("replaced", 0))
        self._fresh = self.offset == 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- reading
    def _restart(self) -> None:
        self.offset, self.sig, self._fresh = 0, b"", True
        self.replaced += 1

    def _read(self, read_at: Callable[[int, int], bytes], consume: Consumer) -> None:
        """Read from the offset to the end of the file or of this poll's byte budget."""
        block, grow = _BLOCK, False
        while self.budget > 0 or grow:
            size = block if grow else min(block, self.budget)
            data = read_at(size, self.offset)
            if not data:
                return
            self.budget -= len(data)
            final = len(data) < size  # a short read: the end of the file for now
            used = consume(data, self._fresh, final)
            if used:
                self._advance(data, used)
            if final:
                return
            grow = not used  # no complete record in the block: read a larger one
            if grow and size >= _MAX_BLOCK:  # one record longer than 64 MiB: skip it
                self._advance(data, len(data))
                grow = False
            elif grow:
                block = size * 2

    def _advance(self, data: bytes, used: int) -> None:
        self.sig = (self.sig + data[:used])[-_SIG:]
        self.offset += used
        self._fresh = False

    def _sig_ok(self, read_at: Callable[[int, int], bytes]) -> bool:
        if not self.sig:
            return True
        return read_at(len(self.sig), self.offset - len(self.sig)) == self.sig

    def poll(self, consume: Consumer) -> None:
        """Read what is new, at most about :data:`POLL_BYTES` (the rest on the next polls);
        a missing file is not an error."""
        self.budget = POLL_BYTES
        try:
            self._poll(consume)
        finally:
            self.more = self.budget <= 0

    def _poll(self, consume: Consumer) -> None:
        if self.uri:
            self._poll_uri(consume)
            return
        if self.fd is not None:
            fd0 = self.fd  # drain the file we have open (maybe rotated away)
            self._read(lambda n, o: os.pread(fd0, n, o), consume)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return  # rotated away, the new file is not there yet
        ident = (st.st_dev, st.st_ino)
        if self.fd is None or ident != self.ident:
            if self.fd is not None or (self.ident is not None and ident != self.ident):
                self._restart()  # rotation: a new file at this path
            self.close()
            self.fd = os.open(self.path, os.O_RDONLY)
            self.ident = (os.fstat(self.fd).st_dev, os.fstat(self.fd).st_ino)
        fd = self.fd
        size = os.fstat(fd).st_size
        if size < self.offset or not self._sig_ok(lambda n, o: os.pread(fd, n, o)):
            self._restart()  # truncated (and maybe refilled)
        self._read(lambda n, o: os.pread(fd, n, o), consume)

    def _poll_uri(self, consume: Consumer) -> None:
        fs, inner = pafs.FileSystem.from_uri(self.path)
        info = fs.get_file_info(inner)
        if info.type != pafs.FileType.File:
            return
        with fs.open_input_file(inner) as fh:
            def read_at(n: int, o: int) -> bytes:
                return bytes(fh.read_at(n, o))

            if info.size < self.offset or not self._sig_ok(read_at):
                self._restart()
            self._read(read_at, consume)


# ---------------------------------------------------------------------------- sources
def _split_lines(data: bytes, final: bool, complete: Callable[[bytes], bool]
                 ) -> tuple[list[bytes], int]:
    """Complete lines of ``data`` and the bytes they use; an unterminated last line counts
    when ``final`` and ``complete(line)``."""
    end = data.rfind(b"\n")
    lines = data[:end].split(b"\n") if end >= 0 else []
    used = end + 1
    rest = data[used:]
    if final and rest.strip(BLANK) and complete(rest):
        lines.append(rest)
        used = len(data)
    return lines, used


class _LineSource:
    """A JSONL / CSV / Megatron text file followed by a :class:`_Tail`."""

    def __init__(self, path: str, fmt: str, step_column: str | None = None) -> None:
        self.path, self.fmt, self.step_column = path, fmt, step_column
        self.tail = _Tail(path)
        self.header: list[str] | None = None
        self.megatron = _MegatronParser(path, strict=False)
        self.bad_lines = 0
        self._rows: list[Row] = []

    @property
    def more(self) -> bool:
        """More bytes wait beyond this poll's budget."""
        return self.tail.more

    def state_dict(self) -> dict[str, Any]:
        return {"tail": self.tail.state_dict(), "header": self.header}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.tail.load_state_dict(d.get("tail", {}))
        self.header = d.get("header")

    def close(self) -> None:
        self.tail.close()

    def poll(self) -> list[Row]:
        self._rows = []
        self.tail.poll(self._consume)
        return self._rows

    def _complete(self, line: bytes) -> bool:
        if self.fmt != "jsonl":
            return False  # a CSV / log line may still be growing
        try:
            return isinstance(json.loads(line), dict)
        except ValueError:
            return False

    def _consume(self, data: bytes, reset: bool, final: bool) -> int:
        if reset:
            self.header = None
            self.megatron = _MegatronParser(self.path, strict=False)
        lines, used = _split_lines(data, final, self._complete)
        text = [ln.decode("utf-8", errors="replace") for ln in lines]
        if self.fmt == "jsonl":
            self._jsonl(text)
        elif self.fmt == "csv":
            self._csv(text)
        else:
            for step, row in self.megatron.parse(text):
                self._rows.append((self.path, step, {k: float(v) for k, v in row.items()
                                                     if v is not None}))
        return used

    def _bad(self, what: str) -> None:
        self.bad_lines += 1
        if self.bad_lines == 1:
            logger.warning("%s: %s; skipped (further bad lines are counted)", self.path, what)

    def _values(self, row: Mapping[str, Any], where: str) -> None:
        step_name = self.step_column or next((c for c in STEP_CANDIDATES if c in row), None)
        raw = row.get(step_name) if step_name is not None else None
        step = _step_value(raw)
        if step is None:
            self._bad(f"{where}: no step (looked for {list(STEP_CANDIDATES)})")
            return
        out: dict[str, float] = {}
        for k, v in row.items():
            if k == step_name or v is None:
                continue
            if isinstance(v, (bool, int, float)):
                out[k] = float(v)
            elif isinstance(v, str):
                f = _parse_number(v)
                if f is not None:
                    out[k] = f
        self._rows.append((self.path, step, out))

    def _jsonl(self, lines: Sequence[str]) -> None:
        for line in lines:
            if not line.strip(BLANK.decode()):
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):
                self._bad(f"invalid JSON line {line[:60]!r}")
                continue
            if not isinstance(obj, dict):
                self._bad("a JSON line that is not an object")
                continue
            try:
                self._values(_flat_row(obj, self.path, "line"), "line")
            except RunFormatError as exc:
                self._bad(str(exc))

    def _csv(self, lines: Sequence[str]) -> None:
        delim = "\t" if self.path.lower().endswith(".tsv") else ","
        for cells in csv.reader(lines, delimiter=delim):
            if not cells:
                continue
            if self.header is None:
                self.header = cells
                continue
            row = {k: (v if v != "" else None)
                   for k, v in zip(self.header, cells, strict=False)}
            self._values(row, "row")


def _step_value(raw: Any) -> int | None:
    if isinstance(raw, bool) or raw is None:
        return None
    if isinstance(raw, str):
        f = _parse_number(raw)
        raw = f
    if isinstance(raw, float):
        if not math.isfinite(raw) or raw != int(raw):
            return None
        raw = int(raw)
    return raw if isinstance(raw, int) and raw >= 0 else None


class _TensorBoardSource:
    """Every ``*tfevents*`` file of a directory (or one file), tailed record by record."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tails: dict[str, _Tail] = {}
        self._rows: list[Row] = []

    @property
    def more(self) -> bool:
        """More bytes wait beyond this poll's budget."""
        return any(t.more for t in self.tails.values())

    def state_dict(self) -> dict[str, Any]:
        return {"files": {f: t.state_dict() for f, t in self.tails.items()}}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        for f, st in d.get("files", {}).items():
            self.tails[f] = _Tail(f)
            self.tails[f].load_state_dict(st)

    def close(self) -> None:
        for t in self.tails.values():
            t.close()

    def poll(self) -> list[Row]:
        self._rows = []
        try:
            files, _ = _event_files(self.path)
        except RunFormatError:
            return []  # no event file yet
        for fname, prefix in files:
            tail = self.tails.get(fname)
            if tail is None:
                tail = self.tails[fname] = _Tail(fname)
            tail.poll(functools.partial(self._consume, fname, prefix))
        return self._rows

    def _consume(self, fname: str, prefix: str, data: bytes, reset: bool, final: bool) -> int:
        import struct

        pos, n = 0, len(data)
        while pos + 12 <= n:
            (length,) = struct.unpack_from("<Q", data, pos)
            (len_crc,) = struct.unpack_from("<I", data, pos + 8)
            if masked_crc32c(data[pos:pos + 8]) != len_crc:
                logger.warning("%s: corrupted TFRecord at byte offset %d of this read; the "
                               "rest of the file is skipped", fname, pos)
                pos = n
                break
            if pos + 12 + length + 4 > n:
                break
            pos += 12 + length + 4
        if pos:
            try:
                for step, tag, value in iter_scalars(data[:pos], fname):
                    self._rows.append((fname, step, {prefix + tag: value}))
            except RunFormatError as exc:
                logger.warning("%s; skipped", exc)
        return pos


class _PartsSource:
    """A recorder directory: every new ``part-*.parquet`` file is read once, in part order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {"seen": sorted(self.seen)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.seen = set(d.get("seen", []))

    def close(self) -> None:
        pass

    def poll(self) -> list[Row]:
        from replay.reader import read_run

        info = _info(self.path)
        if info is None:
            return []
        fs, inner, _ = info
        names = sorted((i.base_name for i in fs.get_file_info(pafs.FileSelector(inner))
                        if _PART.match(i.base_name)), key=lambda b: int(_PART.match(b)[1]))  # type: ignore[index]
        if self.seen and not self.seen & set(names):
            self.seen = set()  # the directory was recreated: read it again
        rows: list[Row] = []
        for base in names:
            if base in self.seen:
                continue
            full = self.path.rstrip("/") + "/" + base
            try:
                table = read_run(full)
            except RunFormatError as exc:
                logger.warning("%s; will retry", exc)
                break
            self.seen.add(base)
            rows.extend(_table_rows(self.path, table))
        return rows


def _table_rows(stream: str, table: pa.Table) -> Iterable[Row]:
    cols = table.to_pydict()
    steps = cols.pop("step")
    for i, s in enumerate(steps):
        yield stream, int(s), {k: float(v[i]) for k, v in cols.items() if v[i] is not None}


def _make_source(spec: str, fmt: str | None, step_column: str | None) -> Any:
    fmt = fmt or detect_watch_format(spec)
    if fmt is None:
        return None
    if fmt not in _FORMATS:
        raise ValueError(f"{spec}: cannot watch format {fmt!r}; watchable: {list(_FORMATS)}")
    if fmt == "tensorboard":
        return _TensorBoardSource(spec)
    if fmt == "parquet":
        info = _info(spec)
        if info is not None and info[2] == pafs.FileType.File:
            raise ValueError(f"{spec}: a single Parquet file does not grow; watch its part "
                             "directory (or use `stability replay`)")
        return _PartsSource(spec)
    return _LineSource(spec, fmt, step_column)


# ---------------------------------------------------------------------------- hooks
def parse_hooks(specs: Iterable[str]) -> dict[str, str]:
    """``["stop=CMD", ...]`` -> ``{"stop": "CMD"}`` (kinds: :data:`HOOK_KINDS`).

    >>> parse_hooks(["stop=touch STOP", "skip_step=echo $STABILITY_STEP"])
    {'stop': 'touch STOP', 'skip_step': 'echo $STABILITY_STEP'}
    >>> parse_hooks(["halt=x"])
    Traceback (most recent call last):
    ...
    ValueError: --on halt=x: unknown kind 'halt'; known: alert, checkpoint, reduce_lr, rollback, set_clip, skip_step, stop, alarm, any
    """  # noqa: E501
    out: dict[str, str] = {}
    for spec in specs:
        kind, sep, cmd = spec.partition("=")
        kind = kind.strip()
        if not sep or not cmd.strip():
            raise ValueError(f"--on {spec}: expected KIND=COMMAND")
        if kind not in HOOK_KINDS:
            raise ValueError(f"--on {spec}: unknown kind {kind!r}; known: {', '.join(HOOK_KINDS)}")
        out[kind] = cmd
    return out


def _atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder + replace)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        A ready :class:`~stability.monitor.Monitor` (its own sinks and event log).
    exporter
        Anything with ``update(decision)`` (e.g. a
        :class:`~stability.prometheus.PrometheusExporter`), called for every judged step.
    echo
        Called with one line per alarm / intervention step (default: ``print``; ``None``: quiet).
    hook_timeout
        Seconds a hook command may run.
    backlog
        ``"act"`` (default): what is already in the sources when a watcher starts without a
        saved state is acted on like new steps; ``"quiet"``: it only warms the monitor (and
        goes to the event log) -- no alert sinks, hooks or control file for history.
    """

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
        if format is not None and format not in _FORMATS:
            raise ValueError(f"format must be one of {list(_FORMATS)}. Got {format!r} instead.")
        if monitor is None:
            from stability.events import EventLog
            from stability.monitor import Monitor

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
                           "resumes": self.resumes}}

    def save(self) -> None:
        """Write the state file now (atomically); no-op without ``state``."""
        if self.state_path is None:
            return
        _atomic_write(self.state_path, json.dumps(self.state_dict()))
        self._saved_at = time.monotonic()

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
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: unusable watch state ({exc}); move it away to start "
                             "afresh") from None

    # ------------------------------------------------------------------ reading
    def _source(self, spec: str) -> Any:
        src = self._sources[spec]
        if src is None:
            src = _make_source(spec, self.format, self.step_column)
            if src is not None:
                saved = self._loaded_sources.pop(spec, None)
                if saved is not None:
                    src.load_state_dict(saved)
                self._sources[spec] = src
        return src

    def poll(self) -> list[Decision]:
        """Read every source once, judge what is ready; returns the new decisions."""
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
                if old is None or not _differs(old, metrics):
                    self.already_seen += 1
                    continue
                out += self._release(everything=True)
                self._resume(step)
            self._pending.setdefault(step, {}).update(metrics)
        return out

    def _resume(self, step: int) -> None:
        """The job re-ran ``step`` (restarted from a checkpoint): judge from there again."""
        self.resumes += 1
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
                if cmd_kind in self.hooks:
                    self._run_hook(cmd_kind, d, iv.type, iv.reason, getattr(iv, "cause", ""))

    def _write_control(self, d: Decision) -> None:
        ctrl = d.control.to_dict()
        doc = {"step": d.step, "time": time.time(), "control": ctrl,
               "interventions": [i.to_dict() for i in d.interventions],
               "alarms": sorted({a.kind for a in d.alarms})}
        try:
            _atomic_write(self.control_file, json.dumps(doc))  # type: ignore[arg-type]
            self._last_control = ctrl
        except OSError as exc:
            logger.warning("cannot write the control file %s: %s", self.control_file, exc)

    def _run_hook(self, hook: str, d: Decision, kind: str, reason: str, cause: str) -> None:
        env = dict(os.environ, STABILITY_STEP=str(d.step), STABILITY_KIND=kind,
                   STABILITY_REASON=reason, STABILITY_CAUSE=cause,
                   STABILITY_CONTROL=json.dumps(d.control.to_dict()))
        self.hook_runs += 1
        try:
            r = subprocess.run(self.hooks[hook], shell=True, env=env, timeout=self.hook_timeout,
                               check=False)
            if r.returncode != 0:
                self.hook_failures += 1
                logger.warning("hook %s (step %d) exited with status %d", hook, d.step,
                               r.returncode)
        except (OSError, subprocess.SubprocessError) as exc:
            self.hook_failures += 1
            logger.warning("hook %s (step %d) failed: %s", hook, d.step, exc)

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
                    if self._last_rows and not self._stop:
                        continue  # a long backlog: read on until nothing new
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
            pass
        finally:
            self.save()
            ev = getattr(self.monitor, "event_log", None)
            if ev is not None:
                ev.flush()
        return out

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current poll (safe from a signal handler)."""
        self._stop = True

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


def _differs(old: Mapping[str, float], new: Mapping[str, float]) -> bool:
    """Some metric both rows hold has another value (NaN equals NaN)."""
    for k, v in new.items():
        o = old.get(k)
        if o is None:
            continue
        if not (o == v or (math.isnan(o) and math.isnan(v))):
            return True
    return False


def format_decision(d: Decision) -> str:
    """One line for a decision with alarms or interventions.

    >>> from stability.types import Alarm, SkipStep
    >>> format_decision(Decision(7, (Alarm(7, "loss_spike", "loss", 9.1234, 6.0, "warning",
    ...                                    "ewma_z"),), (SkipStep(7, "L1"),)))
    'step 7: loss_spike on loss (ewma_z 9.12 > 6) -> skip_step'
    """
    parts = [f"{a.kind} on {a.signal} ({a.detector} {a.score:.3g} > {a.threshold:.3g})"
             for a in d.alarms[:3]]
    if len(d.alarms) > 3:
        parts.append(f"+{len(d.alarms) - 3} more")
    text = f"step {d.step}: " + ("; ".join(parts) if parts else "no alarm")
    if d.interventions:
        text += " -> " + ", ".join(i.type for i in d.interventions)
    return text
