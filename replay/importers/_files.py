"""File access shared by the importers (local paths or ``pyarrow.fs`` URIs; errors name files)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.schema import RunFormatError

__all__ = ["read_bytes", "read_text"]


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
        if is_uri(text):
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
