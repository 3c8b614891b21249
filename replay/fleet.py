"""Fan-out: one job per run, in local processes or on a Ray cluster -- one code path for
``stability replay``, ``eval`` and ``tune``.

:func:`fan_out` is ``[fn(x) for x in items]`` with the input order kept, on a *backend*:

* ``"local"``: :func:`replay.runs.parallel_map` (a process pool, ``jobs`` processes);
* ``"ray"``: Ray tasks on the cluster at ``address`` (``None``: ``RAY_ADDRESS`` when set, else a
  local Ray instance started for the call and shut down after it; an already initialised Ray
  is used as it is).  Items go in chunks (several runs per task: a task costs milliseconds,
  a small run's replay about as much), results come back in the input order, so a Ray run
  gives exactly the local run's results.

The jobs (``replay.replay._replay_job``, ``_eval_job``, ``replay.tuning_scores._score_job``) are
module-level functions the workers import: every Ray worker needs ``stability`` installed (a
``runtime_env`` or the cluster's image), and the run paths must be readable where the tasks
run -- object storage URIs (``s3://``, ``gs://``: :mod:`pyarrow.fs`) or a shared file system.

Errors: :class:`BackendUnavailable` (one line from the CLI) when Ray is not installed or no
cluster answers at ``address``.

Runs that cannot be read: :func:`fan_out_runs` maps over ``(run_id, path, ...)`` items and,
given a ``failed`` list, turns a job's input error (:data:`INPUT_ERRORS`: a missing or
unreadable file, a malformed run -- never a programming error) into a :class:`RunFailure`
(run id, path, one-line reason) appended there, so one bad file does not throw away every
other run's result.  The error is caught inside the job, on the worker (local process or Ray
task), so the same failures come back whatever the backend.

Examples
--------
>>> fan_out(abs, [-2, 3, -4], backend="local", jobs=1, progress=False)
[2, 3, 4]
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["BACKENDS", "INPUT_ERRORS", "BackendUnavailable", "RunFailure", "describe_error",
           "fan_out", "fan_out_runs", "ray_session"]

T = TypeVar("T")
R = TypeVar("R")

#: backends :func:`fan_out` knows (``--backend`` on the command line)
BACKENDS = ("local", "ray")

#: Ray tasks per cluster CPU: enough chunks to balance uneven runs, few enough to keep the
#: per-task overhead small
TASKS_PER_CPU = 4


class BackendUnavailable(RuntimeError):
    """The backend cannot run here: Ray is not installed, or no cluster answers."""


def fan_out(fn: Callable[[T], R], items: Sequence[T], *, backend: str = "local",
            jobs: int | None = None, label: str = "", progress: bool | None = None,
            address: str | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on ``backend`` (order kept; see the module docstring).

    Parameters
    ----------
    fn
        A module-level function (pickled by reference).
    items
        Its arguments, one job each.
    backend
        ``"local"`` or ``"ray"``.
    jobs
        Local processes (default: the cores); with Ray, the number of tasks (default:
        :data:`TASKS_PER_CPU` per cluster CPU).
    label
        Progress bar label.
    progress
        Draw a bar on stderr (``None``: when stderr is a TTY).
    address
        Ray cluster address (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``).
    """
    if backend == "local":
        from replay.runs import parallel_map

        return parallel_map(fn, items, jobs, label, progress)
    if backend == "ray":
        with ray_session(address) as ray:
            return _ray_map(ray, fn, items, jobs, f"{label} (ray)".strip(), progress)
    raise ValueError(f"The 'backend' parameter must be one of {list(BACKENDS)}. "
                     f"Got {backend!r} instead.")


#: what a run's input can raise (a missing, unreadable or malformed file: the importers'
#: ``RunFormatError`` is a ``ValueError``, as are Arrow's and JSON's parse errors); anything
#: else is a bug and propagates
INPUT_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, RecursionError,
                                                 MemoryError)


def describe_error(exc: BaseException) -> str:
    """One line for a user error, naming the file when the exception knows it.

    >>> describe_error(FileNotFoundError(2, "No such file or directory", "runs/x.parquet"))
    'runs/x.parquet: No such file or directory'
    >>> describe_error(ValueError("run.csv: no step column"))
    'run.csv: no step column'
    >>> describe_error(RecursionError("maximum recursion depth exceeded"))
    'input nested too deeply (maximum recursion depth exceeded)'
    """
    if isinstance(exc, OSError) and exc.filename is not None:
        where = os.fsdecode(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)}"
        return f"{where}: {exc.strerror or exc}"
    if isinstance(exc, RecursionError):
        return f"input nested too deeply ({exc})"
    if isinstance(exc, MemoryError):
        return f"out of memory ({exc or 'MemoryError'})"
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())  # one line


@dataclass(frozen=True)
class RunFailure:
    """A run whose job failed on its input: which run, where, and why (one line).

    >>> f = RunFailure("a", "runs/a.jsonl", "runs/a.jsonl: no numeric metric columns")
    >>> f.line()
    'run a: runs/a.jsonl: no numeric metric columns'
    >>> RunFailure("b", "runs/b.csv", "no step column").summary()["error"]
    'runs/b.csv: no step column'
    """

    run_id: str
    path: str
    reason: str

    def message(self) -> str:
        """The reason, naming the file (prefixed with the path when it does not)."""
        return self.reason if self.path in self.reason else f"{self.path}: {self.reason}"

    def line(self) -> str:
        """One line for people: run id, file, reason."""
        return f"run {self.run_id}: {self.message()}"

    def summary(self) -> dict[str, str]:
        """The JSON entry of a failed run (``error`` says why)."""
        return {"run_id": self.run_id, "path": self.path, "error": self.message()}


class _ReportInputErrors(Generic[T, R]):
    """``fn`` on a ``(run_id, path, ...)`` item, an input error returned as a
    :class:`RunFailure` (a module-level class: picklable for processes and Ray)."""

    def __init__(self, fn: Callable[[T], R]) -> None:
        self.fn = fn

    def __call__(self, item: T) -> R | RunFailure:
        try:
            return self.fn(item)
        except INPUT_ERRORS as exc:
            rid, path = item[0], item[1]  # type: ignore[index]
            return RunFailure(str(rid), str(path), describe_error(exc))


def fan_out_runs(fn: Callable[[T], R], items: Sequence[T], *,
                 failed: list[RunFailure] | None = None, **kwargs: Any) -> list[R]:
    """:func:`fan_out` over ``(run_id, path, ...)`` items, keeping going past unreadable runs.

    With ``failed`` (a list), a run whose job raises one of :data:`INPUT_ERRORS` is appended
    there as a :class:`RunFailure` (in input order) and left out of the results; every other
    run is still done.  Without it (``None``) the first such error propagates, as from
    :func:`fan_out`.  ``kwargs`` go to :func:`fan_out`.

    >>> def job(item): return int(item[1])
    >>> failed = []
    >>> fan_out_runs(job, [("a", "1"), ("b", "x"), ("c", "3")], failed=failed,
    ...              backend="local", jobs=1, progress=False)
    [1, 3]
    >>> [f.run_id for f in failed]
    ['b']
    """
    if failed is None:
        return fan_out(fn, items, **kwargs)
    out = fan_out(_ReportInputErrors(fn), items, **kwargs)
    failed.extend(r for r in out if isinstance(r, RunFailure))
    return [r for r in out if not isinstance(r, RunFailure)]


class ray_session:
    """Connect to (or start) Ray for the ``with`` block; a Ray this call started is shut down.

    ``address=None`` uses ``RAY_ADDRESS`` when set, else starts a local instance; an already
    initialised Ray is reused (and left running).
    """

    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS")
        self.started = False

    def __enter__(self) -> Any:
        try:
            import ray
        except ImportError:
            raise BackendUnavailable("backend 'ray' needs Ray: pip install 'ray'") from None
        self.ray = ray
        if ray.is_initialized():
            return ray
        _check_reachable(self.address)
        try:
            ray.init(address=self.address or None, include_dashboard=False,
                     log_to_driver=False, ignore_reinit_error=True)
        except (ConnectionError, TimeoutError, RuntimeError, ValueError) as exc:
            where = self.address or "a new local instance"
            raise BackendUnavailable(f"no Ray cluster reachable at {where} "
                                     f"({' '.join(str(exc).split())[:200]})") from None
        self.started = True
        return ray

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.ray.shutdown()


#: seconds a TCP connection to a cluster address may take before it counts as unreachable
CONNECT_TIMEOUT = 10.0


def _check_reachable(address: str | None) -> None:
    """Fail fast on a ``host:port`` / ``ray://host:port`` address nobody listens on (Ray itself
    retries for minutes).  ``None``, ``"auto"`` and ``"local"`` are left to Ray."""
    import socket

    if not address or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise BackendUnavailable(f"Ray address {address!r} is not HOST:PORT, ray://HOST:PORT "
                                 "or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise BackendUnavailable(f"no Ray cluster reachable at {address} ({exc})") from None


def _chunks(n: int, tasks: int) -> list[range]:
    """``tasks`` (at most ``n``) contiguous index ranges covering ``range(n)``.

    >>> [list(r) for r in _chunks(5, 2)]
    [[0, 1, 2], [3, 4]]
    """
    size = max(1, math.ceil(n / max(1, tasks)))
    return [range(i, min(n, i + size)) for i in range(0, n, size)]


def _run_chunk(fn: Callable[[Any], Any], chunk: Sequence[Any]) -> list[Any]:
    """One Ray task: ``fn`` over a chunk of items, in order."""
    return [fn(x) for x in chunk]


def _ray_map(ray: Any, fn: Callable[[T], R], items: Sequence[T], tasks: int | None,
             label: str, progress: bool | None) -> list[R]:
    from replay.runs import Progress

    n = len(items)
    if tasks is None:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        tasks = TASKS_PER_CPU * max(1, cpus)
    chunks = _chunks(n, tasks)
    remote = ray.remote(_run_chunk)
    fn_ref = ray.put(fn)
    refs = {remote.remote(fn_ref, [items[i] for i in c]): c for c in chunks}
    out: list[Any] = [None] * n
    bar = Progress(n, label, progress)
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                chunk = refs[ref]
                for i, r in zip(chunk, ray.get(ref), strict=True):
                    out[i] = r
                bar.update(len(chunk))
    finally:
        bar.close()
    return out
