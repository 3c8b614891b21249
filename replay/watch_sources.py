"""The sources ``stability watch`` follows: format detection, byte tailing that survives rotation
and truncation, and one reader per format (JSONL/CSV lines, Megatron/DeepSpeed logs, TensorBoard
event files, recorder part directories), each yielding ``(stream, step, metrics)`` rows.

Used by :class:`replay.watch.Watcher`; see its module docstring for the step rules.
"""

from __future__ import annotations

import base64
import csv
import functools
import json
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.importers._stream import BLANK
from replay.importers.megatron import _Parser as _MegatronParser
from replay.importers.tabular import STEP_CANDIDATES, _flat_row, _parse_number
from replay.importers.tensorboard import _event_files, iter_scalars, masked_crc32c
from replay.schema import RunFormatError

__all__ = ["FORMATS", "POLL_BYTES", "Row", "detect_watch_format", "make_source"]

logger = logging.getLogger("stability.watch")

#: bytes read from one file per poll (a long backlog is read over several polls)
POLL_BYTES = 64 << 20
_BLOCK = 4 << 20
_MAX_BLOCK = 64 << 20
_SIG = 64  # bytes before the offset that must not change between polls
_PART = re.compile(r"^part-(\d+)\.parquet$")
#: formats `stability watch --format` accepts
FORMATS = ("jsonl", "csv", "megatron", "tensorboard", "parquet", "hf_trainer")

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
    return {"json": "jsonl"}.get(fmt, fmt)


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
        self._not_regular = False  # reported once: a FIFO / device is never opened

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
        if not stat.S_ISREG(st.st_mode):
            # a FIFO without a writer would block open() forever (and SIGTERM with it); a
            # device never ends: only regular files are followed
            if not self._not_regular:
                self._not_regular = True
                logger.warning("%s is not a regular file (a FIFO or a device); not read. "
                               "Point watch at the file the job writes.", self.path)
            return
        self._not_regular = False
        ident = (st.st_dev, st.st_ino)
        if self.fd is None or ident != self.ident:
            if self.fd is not None or (self.ident is not None and ident != self.ident):
                self._restart()  # rotation: a new file at this path
            self.close()
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # (never blocks)
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
        for line in lines:
            try:  # one line at a time: a stray CR or quote spoils that row only
                cells = next(csv.reader([line.removesuffix("\r")], delimiter=delim), [])
            except csv.Error as exc:
                self._bad(f"unreadable CSV row {line[:60]!r} ({exc})")
                continue
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
        self.bad_records = 0

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
            self._record(fname, prefix, data[pos:pos + 12 + length + 4])
            pos += 12 + length + 4
        return pos

    def _record(self, fname: str, prefix: str, framed: bytes) -> None:
        """One complete TFRecord: its scalars, or (a payload CRC mismatch, an undecodable
        Event) skipped alone -- the records after it are still read."""
        try:
            rows = [(fname, step, {prefix + tag: value})
                    for step, tag, value in iter_scalars(framed, fname)]
        except RunFormatError as exc:
            self.bad_records += 1
            if self.bad_records == 1:
                logger.warning("%s; that record is skipped (further bad records are counted)",
                               exc)
            return
        self._rows.extend(rows)


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


class _TrainerStateSource:
    """An HF ``trainer_state.json``: one JSON document the Trainer rewrites at every save.

    Read whole (``replay.importers.hf_trainer.read_trainer_state``) whenever its size or
    modification time changed; only the steps after the last one read are new rows.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.last_step = -1
        self._seen: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.last_step = int(d.get("last_step", -1))

    def close(self) -> None:
        pass

    def poll(self) -> list[Row]:
        from replay.importers.hf_trainer import read_trainer_state

        try:
            st = os.stat(self.path)
        except OSError:
            return []
        ident = (st.st_size, st.st_mtime_ns)
        if ident == self._seen:
            return []
        try:
            table = read_trainer_state(self.path)
        except RunFormatError as exc:  # caught mid-rewrite: read it again next poll
            logger.warning("%s; will retry", exc)
            return []
        self._seen = ident
        rows = [r for r in _table_rows(self.path, table) if r[1] > self.last_step]
        if rows:
            self.last_step = max(r[1] for r in rows)
        return rows


def _table_rows(stream: str, table: pa.Table) -> Iterable[Row]:
    cols = table.to_pydict()
    steps = cols.pop("step")
    for i, s in enumerate(steps):
        yield stream, int(s), {k: float(v[i]) for k, v in cols.items() if v[i] is not None}


def make_source(spec: str, fmt: str | None, step_column: str | None) -> Any:
    fmt = fmt or detect_watch_format(spec)
    if fmt is None:
        return None
    if fmt not in FORMATS:
        raise ValueError(f"{spec}: cannot watch format {fmt!r}; watchable: {list(FORMATS)}")
    if fmt == "tensorboard":
        return _TensorBoardSource(spec)
    if fmt == "hf_trainer":
        return _TrainerStateSource(spec)
    if fmt == "parquet":
        info = _info(spec)
        if info is not None and info[2] == pafs.FileType.File:
            raise ValueError(f"{spec}: a single Parquet file does not grow; watch its part "
                             "directory (or use `stability replay`)")
        return _PartsSource(spec)
    return _LineSource(spec, fmt, step_column)
