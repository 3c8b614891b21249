"""Importers: turn the files where runs really live into the recorded-run schema.

Every importer returns the same wide table as :func:`replay.reader.read_run` (``step`` int64,
float64 metrics, null = not logged, NaN = NaN, ``b"stability"`` metadata naming the source) and
raises :class:`replay.schema.RunFormatError` naming the file for anything it cannot read.

========================  ==============================================  ====================
format                    function                                        module
========================  ==============================================  ====================
TensorBoard event files   :func:`read_tensorboard`                        ``tensorboard``
HF ``trainer_state.json`` :func:`read_trainer_state`                      ``hf_trainer``
Megatron / DeepSpeed log  :func:`read_megatron_log`, ``parse_megatron_lines``  ``megatron``
CSV / TSV / JSONL / JSON  :func:`read_csv`, :func:`read_jsonl`            ``tabular``
========================  ==============================================  ====================

:func:`replay.io.load_run` picks the right one from the path.

Paths may be local or URIs that :func:`pyarrow.fs.FileSystem.from_uri` understands.
"""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.fs as pafs

from replay.schema import RunFormatError

__all__ = [
    "read_bytes",
    "read_csv",
    "read_json",
    "read_jsonl",
    "read_megatron_log",
    "read_tensorboard",
    "read_text",
    "read_trainer_state",
]


def _is_uri(path: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", path))


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """Whole content of a local file or URI; errors name the file.

    Examples
    --------
    >>> read_bytes("/nonexistent/file")
    Traceback (most recent call last):
    ...
    replay.schema.RunFormatError: /nonexistent/file: cannot read (No such file or directory)
    """
    text = os.fspath(path)
    try:
        if _is_uri(text):
            fs, inner = pafs.FileSystem.from_uri(text)
            with fs.open_input_stream(inner) as f:
                return bytes(f.read())
        with open(text, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise RunFormatError(text, "cannot read (No such file or directory)") from None
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise RunFormatError(text, f"cannot read ({exc})") from None


def read_text(path: str | os.PathLike[str]) -> str:
    """Content of a text file as ``str`` (UTF-8, undecodable bytes replaced).

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
    ...     _ = f.write("hello")
    >>> read_text(f.name)
    'hello'
    """
    return read_bytes(path).decode("utf-8", errors="replace")


# imported last: the submodules use the helpers above
from replay.importers.hf_trainer import read_trainer_state  # noqa: E402
from replay.importers.megatron import read_megatron_log  # noqa: E402
from replay.importers.tabular import read_csv, read_json, read_jsonl  # noqa: E402
from replay.importers.tensorboard import read_tensorboard  # noqa: E402
