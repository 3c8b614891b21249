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

Examples
--------
>>> fan_out(abs, [-2, 3, -4], backend="local", jobs=1, progress=False)
[2, 3, 4]
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["BACKENDS", "BackendUnavailable", "fan_out", "ray_session"]

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
