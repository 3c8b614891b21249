"""One entry point for every run format: :func:`load_run` detects the format and reads the run.

================  ===========================================================================
format            detected from
================  ===========================================================================
``parquet``       ``*.parquet``, a directory of ``*.parquet`` parts, a glob, ``PAR1`` magic
``tensorboard``   ``*tfevents*`` file names, or a directory containing some
``hf_trainer``    ``trainer_state.json`` (or a checkpoint directory holding one), a JSON object
                  with ``log_history``
``megatron``      ``*.log`` / ``*.out`` / ``*.err`` / ``*.txt`` or text containing
                  ``iteration N/ M |`` lines
``csv``           ``*.csv``, ``*.tsv``
``jsonl``         ``*.jsonl``, ``*.ndjson``
``json``          other ``*.json`` (list of rows or object of column lists)
================  ===========================================================================

Every format comes back in the recorded-run schema, column names mapped through the same aliases
as :func:`replay.reader.read_run`.

Examples
--------
>>> import tempfile, os
>>> p = os.path.join(tempfile.mkdtemp(), "train.log")
>>> _ = open(p, "w").write(" iteration 5/ 10 | learning rate: 1.0E-04 | lm loss: 2.5E+00 |\\n")
>>> detect_format(p)
'megatron'
>>> load_run(p, columns=["loss", "lr"]).to_pydict()
{'step': [5], 'loss': [2.5], 'lr': [0.0001]}
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.importers._stream import open_binary
from replay.importers.hf_trainer import read_trainer_state
from replay.importers.megatron import read_megatron_log
from replay.importers.tabular import read_csv, read_json, read_jsonl
from replay.importers.tensorboard import read_tensorboard
from replay.reader import default_aliases, read_run
from replay.schema import STEP, RunFormatError, apply_aliases

__all__ = ["FORMATS", "detect_format", "load_run"]

FORMATS = ("parquet", "tensorboard", "hf_trainer", "megatron", "csv", "jsonl", "json")

_TEXT_EXT = (".log", ".out", ".err", ".txt")
_MEGATRON = re.compile(
    rb"\biteration\s+\d+\s*/\s*\d+\s*\||validation loss at iteration|steps:\s*\d+\s+loss:"
)


def _listing(path: str) -> tuple[str, list[str]] | None:
    """(kind, file base names) for a directory, None for a file; error when missing."""
    if is_uri(path):
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
            info = fs.get_file_info(inner)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise RunFormatError(path, f"cannot open URI ({exc})") from None
    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(path)
        info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        raise RunFormatError(path, "no such file or directory")
    if info.type != pafs.FileType.Directory:
        return None
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    return "dir", [i.base_name for i in infos if i.type == pafs.FileType.File]


def _read_head(path: str, n: int) -> bytes:
    """The first ``n`` bytes (never the whole file: logs can be gigabytes)."""
    with open_binary(path) as fh:
        try:
            return bytes(fh.read(n))
        except OSError as exc:
            raise RunFormatError(path, f"cannot read ({exc})") from None


def detect_format(path: str | os.PathLike[str]) -> str:
    """Guess the format of ``path`` (one of :data:`FORMATS`).

    Raises
    ------
    RunFormatError
        Missing path or nothing recognisable.

    Examples
    --------
    >>> detect_format("runs/*/part-*.parquet")
    'parquet'
    """
    text = os.fspath(path)
    base = text.rstrip("/").rsplit("/", 1)[-1].lower()
    if any(c in text for c in "*?["):
        if base.endswith(".parquet"):
            return "parquet"
        raise RunFormatError(text, "globs are supported for Parquet runs only")
    listing = _listing(text)
    if listing is not None:
        names = listing[1]
        if any(n.startswith("part-") and n.endswith(".parquet") for n in names):
            return "parquet"
        if "trainer_state.json" in names:
            return "hf_trainer"
        if any("tfevents" in n for n in names):
            return "tensorboard"
        if any(n.endswith(".parquet") for n in names):
            return "parquet"
        raise RunFormatError(text, "directory holds no recognisable run files")
    if "tfevents" in base:
        return "tensorboard"
    if base.endswith(".parquet"):
        return "parquet"
    if base == "trainer_state.json":
        return "hf_trainer"
    if base.endswith((".csv", ".tsv")):
        return "csv"
    if base.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    head = _read_head(text, 65536)
    if base.endswith(".json"):
        return "hf_trainer" if b'"log_history"' in head else "json"
    if head.startswith(b"PAR1"):
        return "parquet"
    if base.endswith(_TEXT_EXT) or _MEGATRON.search(head):
        return "megatron"
    stripped = head.lstrip()
    if stripped.startswith(b"{"):
        return "hf_trainer" if b'"log_history"' in head else "jsonl"
    if stripped.startswith(b"["):
        return "json"
    raise RunFormatError(text, "unrecognised run format (pass format=...)")


def load_run(
    path_or_uri: str | os.PathLike[str],
    *,
    format: str | None = None,
    columns: Sequence[str] | None = None,
    aliases: Mapping[str, str] | None = None,
    default_aliases_: bool = True,
    **options: Any,
) -> pa.Table:
    """Read a run in any supported format into the recorded-run schema.

    Parameters
    ----------
    path_or_uri : str or PathLike
        File, directory, glob (Parquet) or URI.
    format : str, optional
        One of :data:`FORMATS`; detected when omitted.
    columns : sequence of str, optional
        Canonical column names to keep (``step`` always kept).
    aliases : mapping, optional
        Extra aliases (raw name -> canonical name) on top of the defaults.
    default_aliases_ : bool
        Apply the default alias table.
    **options
        Passed to the importer (``tags=`` / ``verify_crc=`` for TensorBoard, ``strict=`` for
        Megatron, ``step_column=`` for CSV/JSON).

    Returns
    -------
    pa.Table
    """
    fmt = format or detect_format(path_or_uri)
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}. Got {fmt!r} instead.")
    if fmt == "parquet":
        return read_run(path_or_uri, columns, aliases, default_aliases=default_aliases_, **options)
    readers = {
        "tensorboard": read_tensorboard,
        "hf_trainer": read_trainer_state,
        "megatron": read_megatron_log,
        "csv": read_csv,
        "jsonl": read_jsonl,
        "json": read_json,
    }
    table = readers[fmt](path_or_uri, **options)
    amap = default_aliases() if default_aliases_ else {}
    if aliases:
        amap.update(aliases)
    table = apply_aliases(table, amap)
    if columns is not None:
        keep = [STEP] + [c for c in columns if c in table.column_names and c != STEP]
        table = table.select(keep)
    return table
