"""File-safety rules for every file the library and the CLI write (state, control, outputs).

* :func:`atomic_write` -- a fresh ``O_EXCL`` temporary file with an unpredictable name in the
  destination's directory, fsynced, renamed over the destination.  A symlink planted at the
  temporary name cannot exist (the name is new and created exclusively); a symlink at the
  destination is replaced, never followed.
* ``ours`` -- an existing destination is replaced only if it is one of our own outputs (the
  caller says how to recognise one from its first bytes); anything else -- a checkpoint, a
  config, the job's metrics file, a directory, a FIFO -- is refused with ``ValueError`` and left
  untouched.

>>> import os, tempfile
>>> p = os.path.join(tempfile.mkdtemp(), "state.json")
>>> atomic_write(p, b'{"a": 1}', ours=json_object)
>>> atomic_write(p, b'{"a": 2}', ours=json_object); open(p).read()
'{"a": 2}'
>>> with open(p, "w") as f:
...     _ = f.write("x = 1  # someone's config")
>>> atomic_write(p, b"{}", ours=json_object)
Traceback (most recent call last):
ValueError: ... exists and is not a file this tool wrote; refusing to replace it ...
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable

__all__ = ["HEAD_BYTES", "atomic_write", "check_replaceable", "json_object"]

#: bytes of an existing file shown to the ``ours`` test
HEAD_BYTES = 64


def json_object(head: bytes) -> bool:
    """Whether a file's first bytes look like a JSON object (our state / control files)."""
    return head.lstrip()[:1] == b"{"


def check_replaceable(path: str | os.PathLike[str], ours: Callable[[bytes], bool] | None
                      ) -> None:
    """``ValueError`` unless ``path`` is absent, a symlink (replaced, not followed), an empty
    regular file or a regular file whose first :data:`HEAD_BYTES` bytes pass ``ours``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{os.fspath(path)} exists and is not a regular file; refusing to "
                         "replace it")
    if st.st_size == 0 or ours is None:
        return
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
    if not ours(head):
        raise ValueError(f"{os.fspath(path)} exists and is not a file this tool wrote; "
                         "refusing to replace it (choose another path)")


def atomic_write(path: str | os.PathLike[str], data: bytes,
                 ours: Callable[[bytes], bool] | None = None, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring for the rules)."""
    path = os.fspath(path)
    check_replaceable(path, ours)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
