"""Kernels that run before they are compiled: an interpreted twin while Numba compiles aside.

Every kernel is an ``@njit`` dispatcher whose ``py_func`` is the same code in plain Python.
The first call of a kernel whose machine code is neither compiled nor in the Numba cache would
spend seconds in LLVM on the training thread.  :func:`call` runs the kernel's *interpreted
twin* instead and has the machine code built off the critical path; once it is there, the same
call runs the compiled kernel.  Both read and write the same state arrays, and every kernel
gives bit-identical outputs and state in both forms (``tests/test_coldstart.py`` replays the
golden runs and random streams with missing and non-finite values through both), so a run may
switch from one to the other at any step.

Where the machine code comes from: a daemon thread (``stability-jit``) takes the kernels
requested during one step.  Those the Numba cache already holds it loads (milliseconds each,
plus about a second, once, to initialise Numba's CPU target); the others are built according to
``STABILITY_COLD_START``:

``subprocess`` (default)
    A child process (``python -m detectors._warm``, niced) compiles them into the cache and the
    thread loads them from there.  The child holds no lock of this process: Numba's front end
    is Python code, and compiling in a thread would take the GIL from the training loop for
    seconds.  If the child fails (no interpreter, an unwritable cache), the thread compiles.
``thread``
    The thread compiles them in this process.
``blocking``
    No interpreted twin: the first call compiles (or loads) on the calling thread.

A kernel whose twin raises (Python raises where Numba returns ``inf``/``nan``, e.g.
``math.log(0.0)``) gets its array arguments restored and runs compiled instead, compiled on the
spot.  Large batch calls (``update_many``, replay) call the dispatcher directly.

Public API (used by ``BankDetector`` and by drivers that call kernels themselves):

* :func:`call` -- ``call(kernel, *args)``: the compiled kernel if ready, else the twin.
* :func:`kernel_ready` -- whether ``kernel`` runs machine code without compiling now.
* :func:`interpreted` -- the plain-Python twin of a kernel (njit helpers replaced too).
* :func:`request` -- queue a kernel that has no usable twin (a native driver) for the
  background compiler; :func:`compiling` -- whether it still has work.
* :func:`wait_ready` -- block until every kernel requested so far is compiled.
* :func:`pending` -- the kernels requested and not compiled yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, NamedTuple

import numpy as np
from numba import config as numba_config
from numba import typeof
from numba.core.dispatcher import Dispatcher

__all__ = ["MODES", "cached", "call", "compiling", "interpreted", "kernel_ready", "mode",
           "pending", "request", "set_mode", "using_mode", "wait_ready"]

logger = logging.getLogger(__name__)

#: values of ``STABILITY_COLD_START``
MODES = ("subprocess", "thread", "blocking")
#: seconds the background compiler waits after the first request, so that every kernel of a
#: monitor's first step goes into one child process
DEBOUNCE_S = 0.05
#: niceness of the compiling child (it yields the CPU to the training run)
CHILD_NICE = 5
#: the child is killed after this long (the thread then compiles what is missing)
CHILD_TIMEOUT_S = 900.0

_lock = threading.Lock()
_wake = threading.Condition(_lock)
_ready: set[Any] = set()  # kernels whose compiled form is used (fast path of call())
_queue: dict[Any, tuple[Any, ...]] = {}  # kernel -> signature, waiting for the compiler
_busy: dict[Any, tuple[Any, ...]] = {}  # kernel -> signature, being compiled
_failed: set[Any] = set()  # kernels whose twin raised: compiled on the calling thread
_twins: dict[int, Callable[..., Any]] = {}
_worker: threading.Thread | None = None
_mode: str | None = None


def mode() -> str:
    """The cold-start mode: :func:`set_mode`'s, else ``STABILITY_COLD_START``, else
    ``"subprocess"`` (``"blocking"`` when the JIT is disabled)."""
    if _mode is not None:
        return _mode
    m = os.environ.get("STABILITY_COLD_START", "subprocess").strip().lower() or "subprocess"
    if m not in MODES:
        logger.warning("STABILITY_COLD_START=%r is not one of %s; using 'subprocess'.", m, MODES)
        m = "subprocess"
    return m


def set_mode(value: str | None) -> None:
    """Override ``STABILITY_COLD_START`` for this process (``None``: back to the variable).

    Raises
    ------
    ValueError
        If ``value`` is not one of :data:`MODES`.
    """
    global _mode
    if value is not None and value not in MODES:
        raise ValueError(f"The cold-start mode must be one of {MODES}. Got {value!r} instead.")
    _mode = value


@contextmanager
def using_mode(value: str) -> Iterator[None]:
    """:func:`set_mode` for the duration of a ``with`` block (``stability warmup`` compiles
    with ``"blocking"``)."""
    before = _mode
    set_mode(value)
    try:
        yield
    finally:
        set_mode(before)


# ------------------------------------------------------------------------------ twins
def interpreted(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """The plain-Python twin of a kernel: its ``py_func`` whose njit helpers are twins too.

    The twin runs the kernel's own bytecode with a copy of its module globals in which every
    Numba dispatcher is replaced by that dispatcher's twin (so calling it compiles nothing).
    A plain function (``NUMBA_DISABLE_JIT=1``) is returned as is.
    """
    if not isinstance(kernel, Dispatcher):
        return kernel
    key = id(kernel)
    twin = _twins.get(key)
    if twin is None:
        twin = _make_twin(kernel)
    return twin


def _make_twin(kernel: Dispatcher) -> Callable[..., Any]:
    py = kernel.py_func
    glb: dict[str, Any] = dict(py.__globals__)
    closure = py.__closure__
    twin = types.FunctionType(py.__code__, glb, py.__name__, py.__defaults__, closure)
    twin.__kwdefaults__ = py.__kwdefaults__
    twin.__qualname__ = py.__qualname__
    twin.__doc__ = py.__doc__
    _twins[id(kernel)] = twin  # before recursing: helpers may refer back
    for name in py.__code__.co_names:
        val = glb.get(name)
        if isinstance(val, Dispatcher):
            glb[name] = interpreted(val)
        elif isinstance(val, tuple) and any(isinstance(v, Dispatcher) for v in val):
            glb[name] = tuple(interpreted(v) if isinstance(v, Dispatcher) else v for v in val)
    if closure:
        cells = tuple(types.CellType(interpreted(c.cell_contents))
                      if isinstance(c.cell_contents, Dispatcher) else c for c in closure)
        twin = types.FunctionType(py.__code__, glb, py.__name__, py.__defaults__, cells)
        twin.__kwdefaults__ = py.__kwdefaults__
        twin.__qualname__ = py.__qualname__
        _twins[id(kernel)] = twin
    return twin


# ------------------------------------------------------------------------------ readiness
def kernel_ready(kernel: Callable[..., Any]) -> bool:
    """Whether calling ``kernel`` runs machine code now, without compiling on this thread.

    ``True`` for a plain function (JIT disabled) and for a dispatcher with a compiled
    specialisation (compiled here, loaded from the cache, or built by the background compiler).
    """
    if kernel in _ready:
        return True
    if not isinstance(kernel, Dispatcher):
        return True
    if kernel.overloads:
        _ready.add(kernel)
        return True
    return False


def pending() -> list[str]:
    """Qualified names of the kernels requested and not compiled yet (queued or compiling)."""
    with _lock:
        ks = [*_busy, *_queue]
    return sorted({_name(k) for k in ks if not kernel_ready(k)})


def wait_ready(timeout: float | None = None) -> bool:
    """Block until the background compiler has nothing left; ``False`` on timeout."""
    end = None if timeout is None else time.monotonic() + timeout
    with _lock:
        while _queue or _busy:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            _wake.wait(left if left is not None else 1.0)
    return True


def _name(kernel: Any) -> str:
    py = getattr(kernel, "py_func", kernel)
    return f"{py.__module__}:{py.__qualname__}"


# ------------------------------------------------------------------------------ call
def call(kernel: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)`` with machine code if it is ready, else with the interpreted twin.

    The first call of a kernel that is neither compiled nor cached queues it for the
    background compiler (see the module docstring) and runs the twin; later calls run the
    twin until the compiled kernel is ready.  Array arguments are modified in place exactly
    as the compiled kernel would.
    """
    if kernel in _ready:
        return kernel(*args)
    return _call_cold(kernel, args)


def _call_cold(kernel: Any, args: tuple[Any, ...]) -> Any:
    if kernel_ready(kernel) or kernel in _failed or mode() == "blocking" or _jit_off():
        out = kernel(*args)
        _ready.add(kernel)
        return out
    if kernel not in _queue and kernel not in _busy:
        _request(kernel, tuple(typeof(a) for a in args))
    return _run_twin(kernel, args)


def request(kernel: Callable[..., Any], sig: tuple[Any, ...]) -> bool:
    """Have ``kernel`` built for the Numba signature ``sig`` (a tuple of argument types) without
    running it; ``True`` if its machine code is there now.

    For a kernel that has no twin (a driver that calls native entry points): a cold one is
    queued for the background compiler and ``False`` returned -- use another path meanwhile
    and ask again once :func:`compiling` is ``False``.  In ``blocking`` mode, with the JIT
    disabled, or when the background compiler failed on it, it is compiled here.
    """
    if not isinstance(kernel, Dispatcher):
        return True
    if kernel.overloads.get(tuple(sig)) is not None:
        _ready.add(kernel)
        return True
    if kernel in _failed or mode() == "blocking" or _jit_off():
        kernel.compile(tuple(sig))
        _ready.add(kernel)
        return True
    if kernel not in _queue and kernel not in _busy:
        _request(kernel, tuple(sig))
    return False


def compiling() -> bool:
    """Whether the background compiler has work queued or in hand (no lock: a hint)."""
    return bool(_queue or _busy)


def _run_twin(kernel: Any, args: tuple[Any, ...]) -> Any:
    saved = [(a, a.copy()) for a in args if isinstance(a, np.ndarray) and a.flags.writeable]
    try:
        with np.errstate(all="ignore"):
            return interpreted(kernel)(*args)
    except Exception:
        # Python raised where the machine code returns inf / nan (math.log(0.0), x / 0 on
        # Python floats): undo the partial writes and run the compiled kernel instead.
        logger.debug("interpreted %s raised; compiling it now", _name(kernel), exc_info=True)
        for a, copy in saved:
            a[...] = copy
        _failed.add(kernel)
        return kernel(*args)


def _jit_off() -> bool:
    return bool(getattr(numba_config, "DISABLE_JIT", False))


def cached(kernel: Any, sig: tuple[Any, ...]) -> bool:
    """Whether Numba's cache index lists machine code of ``kernel`` for ``sig``.

    Reads the index file only (Numba's target is not initialised); an entry built for another
    CPU also counts (loading it then compiles, as Numba would).
    """
    try:
        cache = kernel._cache
        index_file = getattr(cache, "_cache_file", None)
        if index_file is None:  # NullCache: cache=False
            return False
        code = cache._py_func.__code__.co_code
        digest = hashlib.sha256(code).hexdigest()
        return any(key[0] == sig and key[2][0] == digest for key in index_file._load_index())
    except Exception:  # a private API changed: treat as cold
        logger.debug("could not read the Numba cache index of %s", _name(kernel), exc_info=True)
        return False


# ------------------------------------------------------------------------------ compiler
def _request(kernel: Any, sig: tuple[Any, ...]) -> None:
    global _worker
    with _lock:
        _queue[kernel] = sig
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_compile_loop, name="stability-jit", daemon=True)
            _worker.start()
        _wake.notify_all()


def _compile_loop() -> None:
    while True:
        with _lock:
            while not _queue:
                _wake.wait()
        time.sleep(DEBOUNCE_S)  # gather the rest of this step's kernels
        with _lock:
            batch = dict(_queue)
            _queue.clear()
            _busy.update(batch)
        try:
            _build(batch)
        except Exception:  # never leave a kernel waiting: it compiles on its next call
            logger.warning("background compilation failed", exc_info=True)
            _failed.update(batch)
        finally:
            with _lock:
                for kernel in batch:
                    _busy.pop(kernel, None)
                _wake.notify_all()


def _build(batch: dict[Any, tuple[Any, ...]]) -> None:
    """Load the cached kernels of ``batch`` while a child compiles the others, then load those."""
    cold = {k: s for k, s in batch.items() if not cached(k, s)}
    child = _start_child(cold) if cold and mode() == "subprocess" else None
    order = [k for k in batch if k not in cold] + [k for k in batch if k in cold]
    for kernel in order:
        if kernel in cold and child is not None:
            _wait_child(child)
            child = None
        try:
            kernel.compile(batch[kernel])  # from the cache, else compiled on this thread
        except Exception:
            logger.warning("background compilation of %s failed; it compiles on first use",
                           _name(kernel), exc_info=True)
            _failed.add(kernel)
        with _lock:
            _busy.pop(kernel, None)
            _wake.notify_all()


def describe(sig: Sequence[Any]) -> list[list[Any]] | None:
    """A JSON description of a signature of arrays and scalars (``None``: anything else).

    An array is ``[dtype, ndim, layout, readonly, aligned]`` (dtype as NumPy's ``dtype.str``),
    a scalar ``[name]`` (``"float64"``, ``"int64"``, ``"bool"``, ...); ``detectors._warm``
    rebuilds the Numba types from it.
    """
    from numba.core import types as nt

    out: list[list[Any]] = []
    for t in sig:
        if type(t) is nt.Array:
            out.append([np.dtype(str(t.dtype)).str, t.ndim, t.layout, not t.mutable, t.aligned])
        elif isinstance(t, (nt.Integer, nt.Float, nt.Boolean)):
            out.append([str(t)])
        else:
            return None
    return out


def _after_fork_in_child() -> None:
    """A forked child has no compiler thread: requeue what it was building, fresh locks."""
    global _lock, _wake, _worker
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _worker = None
    _queue.update(_busy)
    _busy.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _start_child(batch: dict[Any, tuple[Any, ...]]) -> _Child | None:
    """Start ``python -m detectors._warm`` on ``batch`` (``None`` if it cannot run)."""
    jobs = []
    for kernel, sig in batch.items():
        desc = describe(sig)
        if desc is not None:
            py = kernel.py_func
            jobs.append({"module": py.__module__, "qualname": py.__qualname__, "args": desc})
    if not jobs or not sys.executable:
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    env["STABILITY_COLD_START"] = "blocking"
    err = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "detectors._warm", "--nice", str(CHILD_NICE)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env)
        if proc.stdin is not None:
            proc.stdin.write(json.dumps(jobs).encode())
            proc.stdin.close()
    except (OSError, ValueError, subprocess.SubprocessError):
        logger.debug("could not start the compiling child; compiling in this process",
                     exc_info=True)
        err.close()
        return None
    return _Child(proc, err, time.perf_counter(), len(jobs))


class _Child(NamedTuple):
    proc: subprocess.Popen[bytes]
    err: IO[bytes]
    t0: float
    n_jobs: int


def _wait_child(child: _Child) -> None:
    """Wait for the child (killed after :data:`CHILD_TIMEOUT_S`); log how it went."""
    try:
        rc = child.proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.proc.kill()
        rc = child.proc.wait()
    with child.err:
        child.err.seek(0)
        msg = child.err.read()[-2000:].decode(errors="replace")
    if rc != 0:
        logger.debug("compiling child exited with %s: %s", rc, msg)
    else:
        logger.debug("compiling child built %d kernels in %.2f s", child.n_jobs,
                     time.perf_counter() - child.t0)
