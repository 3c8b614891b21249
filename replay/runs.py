"""Finding runs on disk and mapping over them: run specs, reading a run, progress, processes.

Split out of ``replay/replay.py`` (pure move); everything here is also importable from
``replay.replay``.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa

from replay._paths import is_uri
from replay.schema import RunFormatError

T = TypeVar("T")
R = TypeVar("R")

_GLOB = set("*?[")


# ---------------------------------------------------------------------------- finding runs
def _has_parts(d: Path) -> bool:
    return any(d.glob("part-*.parquet"))


#: file name endings of runs in other formats (see :mod:`replay.io`)
_RUN_SUFFIXES = (".parquet", ".jsonl", ".ndjson", ".csv", ".tsv", ".log", ".out")


def _is_run_file(p: Path) -> bool:
    name = p.name.lower()
    return p.is_file() and (name.endswith(_RUN_SUFFIXES) or "tfevents" in name
                            or name == "trainer_state.json")


def _is_run_dir(d: Path) -> bool:
    """A directory that is one run: Parquet parts, TensorBoard events, an HF checkpoint."""
    if _has_parts(d) or (d / "trainer_state.json").is_file():
        return True
    return any("tfevents" in f.name for f in d.rglob("*tfevents*"))


def _run_id(p: Path) -> str:
    name = p.name
    return name if p.is_dir() or "tfevents" in name else p.stem


def discover_runs(spec: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """Resolve a run spec to ``(run_id, path)`` pairs, sorted by run id.

    ``spec`` may be a run file in any format :func:`replay.io.load_run` reads (Parquet, JSONL,
    CSV, a Megatron log, a TensorBoard event file, ``trainer_state.json``), a directory that is
    one run (``part-*.parquet`` files, TensorBoard event files anywhere below it, an HF
    checkpoint), a directory of runs (files and/or run directories), a glob of any of these, or
    a :mod:`pyarrow.fs` URI (``file://``, ``s3://``, ``gs://``, ...) of any of these.  The run
    id is the file stem or the directory name.
    """
    text = os.fspath(spec)
    if is_uri(text):
        return _discover_uri(text)
    if any(c in text for c in _GLOB):
        out: list[tuple[str, str]] = []
        for m in sorted(glob.glob(text)):
            p = Path(m)
            if _is_run_file(p) or (p.is_dir() and _is_run_dir(p)):
                out.append((_run_id(p), str(p)))
        return sorted(out)
    p = Path(text)
    if p.is_file():
        return [(_run_id(p), str(p))]
    if not p.is_dir():
        return []
    if (_has_parts(p) or (p / "trainer_state.json").is_file()
            or any("tfevents" in f.name and f.is_file() for f in p.iterdir())):
        return [(p.name, str(p))]
    out = [(_run_id(f), str(f)) for f in p.iterdir() if _is_run_file(f)]
    out += [(d.name, str(d)) for d in p.iterdir() if d.is_dir() and _is_run_dir(d)]
    if not out and _is_run_dir(p):
        return [(p.name, str(p))]  # TensorBoard events deeper down
    return sorted(out)


def _discover_uri(text: str) -> list[tuple[str, str]]:
    """:func:`discover_runs` for a :mod:`pyarrow.fs` URI: the same rules on the listing of the
    file system (``?query`` options are kept on every run's URI)."""
    import pyarrow.fs as pafs

    from .io import detect_format

    base, sep, query = text.partition("?")
    try:
        fs, inner = pafs.FileSystem.from_uri(text)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise RunFormatError(text, f"cannot open URI ({exc})") from None
    prefix = base[: base.index("://") + 3]
    local = prefix.lower() == "file://"

    def uri(p: str) -> str:
        return (prefix + ("/" + p.lstrip("/") if local else p)) + sep + query

    def one(info: pafs.FileInfo) -> list[tuple[str, str]]:
        u = uri(info.path)
        try:
            detect_format(u)
        except RunFormatError:
            return []
        return [(_run_id(Path(info.path)) if info.type == pafs.FileType.File
                 else Path(info.path).name, u)]

    if any(c in inner for c in _GLOB):
        return sorted(r for i in _uri_glob(fs, inner, text) for r in one(i))
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.File:
        return one(info)
    if info.type != pafs.FileType.Directory:
        return []
    kids = [i for i in fs.get_file_info(pafs.FileSelector(inner))
            if not i.base_name.startswith(".")]
    if any(_is_run_name(i.base_name, whole_dir=True) for i in kids
           if i.type == pafs.FileType.File):
        return one(info)  # the directory is one run (parts, TensorBoard, HF checkpoint)
    out = [r for i in kids if i.type == pafs.FileType.File and _is_run_name(i.base_name)
           for r in one(i)]
    out += [r for i in kids if i.type == pafs.FileType.Directory for r in one(i)]
    return sorted(out)


def _is_run_name(name: str, whole_dir: bool = False) -> bool:
    """A file name that is a run (``whole_dir``: that makes its directory one run)."""
    low = name.lower()
    if whole_dir:
        return (low.startswith("part-") and low.endswith(".parquet")) or "tfevents" in low \
            or low == "trainer_state.json"
    return low.endswith(_RUN_SUFFIXES) or "tfevents" in low or low == "trainer_state.json"


def _uri_glob(fs: Any, inner: str, text: str) -> list[Any]:
    """File-system entries matching a glob in a URI's path."""
    import fnmatch

    import pyarrow.fs as pafs

    parts = inner.split("/")
    k = next(i for i, p in enumerate(parts) if any(c in _GLOB for c in p))
    root = "/".join(parts[:k]) or "/"
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except (pa.ArrowException, OSError) as exc:
        raise RunFormatError(text, f"cannot list {root!r} ({exc})") from None
    depth = inner.count("/")
    return [i for i in infos if i.path.count("/") == depth and fnmatch.fnmatch(i.path, inner)]


def discover_many(specs: Iterable[str]) -> list[tuple[str, str]]:
    """:func:`discover_runs` over several specs; duplicate run ids are an error."""
    out: dict[str, str] = {}
    for spec in specs:
        found = discover_runs(spec)
        if not found:
            raise FileNotFoundError(f"no runs found at {spec!r}")
        for rid, path in found:
            if rid in out and out[rid] != path:
                raise ValueError(f"two runs share the id {rid!r}: {out[rid]} and {path}")
            out[rid] = path
    return sorted(out.items())


def read_table(path: str, aliases: Mapping[str, str] | None = None) -> pa.Table:
    """Read a whole run (any format :func:`replay.io.load_run` reads) as a wide table."""
    from .io import load_run

    return load_run(path, aliases=aliases)


# ---------------------------------------------------------------------------- progress
class Progress:
    """A plain progress bar on stderr, drawn only when stderr is a TTY."""

    def __init__(self, total: int, label: str = "", enabled: bool | None = None):
        self.total = total
        self.label = label
        self.done = 0
        self.t0 = time.perf_counter()
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` items and redraw."""
        self.done += n
        if not self.enabled:
            return
        width = 30
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(width * frac)
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label} [{bar:<{width}}] {self.done}/{self.total} {el:.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        """Finish the line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def parallel_map(fn: Callable[[T], R], items: Sequence[T], jobs: int | None = None,
                 label: str = "", progress: bool | None = None) -> list[R]:
    """``[fn(x) for x in items]`` across processes (order kept), with a progress bar.

    ``jobs=1`` (or a single item) runs in this process.  ``fn`` must be picklable.
    """
    n = len(items)
    jobs = os.cpu_count() or 1 if jobs is None else max(1, jobs)
    bar = Progress(n, label, progress)
    out: list[Any] = [None] * n
    try:
        if jobs == 1 or n <= 1:
            for i, x in enumerate(items):
                out[i] = fn(x)
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, n)) as ex:
                futs = {ex.submit(fn, x): i for i, x in enumerate(items)}
                for f in as_completed(futs):
                    out[futs[f]] = f.result()
                    bar.update()
    finally:
        bar.close()
    return out
