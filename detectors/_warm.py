"""Compile kernels into the Numba cache: the child process of :mod:`detectors.dispatch`.

Reads a JSON list on stdin, one job per kernel::

    [{"module": "detectors.ewma", "qualname": "_kernel",
      "args": [["<f8", 3, "C", false, true], ...]}]

``args`` describes each argument: an array as ``[dtype, ndim, layout, readonly, aligned]``, a
scalar as ``[numba type name]``, as :func:`detectors.dispatch.describe` writes it.  Each kernel
is compiled for exactly that signature (``cache=True`` writes it to the cache); nothing is run.
Exit status 0 when every job compiled, 1 otherwise (one line per failure on stderr).  Children
of several processes (the ranks of a job) take turns on a lock file in the cache directory, so
that the first compiles and the others load its cache entries.

    python -m detectors._warm [--nice N] < jobs.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def compile_job(job: dict[str, Any]) -> None:
    """Import ``job["module"]``, find the dispatcher and compile it for ``job["args"]``."""
    import numpy as np
    from numba import from_dtype
    from numba.core import types

    obj: Any = importlib.import_module(job["module"])
    for part in job["qualname"].split("."):
        obj = getattr(obj, part)
    array: Any = types.Array
    sig = []
    for arg in job["args"]:
        if len(arg) == 1:  # a scalar: "float64", "int64", "bool", ...
            sig.append(types.boolean if arg[0] == "bool" else getattr(types, arg[0]))
        else:
            dt, ndim, layout, ro, al = arg
            sig.append(array(from_dtype(np.dtype(dt)), int(ndim), str(layout),
                             readonly=bool(ro), aligned=bool(al)))
    obj.compile(tuple(sig))


def main(argv: list[str] | None = None) -> int:
    """Compile every job read from stdin; 0 if all compiled."""
    ap = argparse.ArgumentParser(prog="python -m detectors._warm")
    ap.add_argument("--nice", type=int, default=0, help="lower this process's priority first")
    a = ap.parse_args(argv)
    if a.nice > 0 and hasattr(os, "nice"):
        try:
            os.nice(a.nice)
        except OSError:
            pass
    jobs = json.loads(sys.stdin.read())
    bad = 0
    with _one_at_a_time():
        for job in jobs:
            try:
                compile_job(job)
            except Exception as exc:  # report and go on: the parent compiles what is missing
                bad += 1
                print(f"{job.get('module')}:{job.get('qualname')}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    return 1 if bad else 0


@contextmanager
def _one_at_a_time() -> Iterator[None]:
    """Hold an exclusive lock on ``stability-warm.lock`` in the cache directory (or the temp
    directory) where the platform has ``flock``: the ranks of a job that start together then
    compile once, and the others load what the first wrote.  Without a lock, all compile."""
    from numba import config

    folder = getattr(config, "CACHE_DIR", "") or tempfile.gettempdir()
    try:
        import fcntl

        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, "stability-warm.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


if __name__ == "__main__":
    sys.exit(main())
