"""Path helpers shared by every reader: a run may be a local path or a ``pyarrow.fs`` URI."""

from __future__ import annotations

import re

__all__ = ["is_uri"]

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_uri(path: str) -> bool:
    """``True`` for ``scheme://...`` (``file://``, ``s3://``, ``gs://``, ...).

    >>> is_uri("s3://bucket/run"), is_uri("runs/a.parquet"), is_uri("C:/x")
    (True, False, False)
    """
    return bool(_URI.match(path))
