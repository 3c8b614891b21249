"""Multi-process gloo harness shared by the distributed adapter tests (CPU, spawned ranks).

A worker is ``worker(rank, world, port, out_dir, *args)``: it runs its ranks's loop inside
:func:`process_group`, writes ``rank{rank}.json`` into ``out_dir`` and ends with ``os._exit(0)``
(torch's gloo teardown can abort in C++ static destructors at interpreter exit).
:func:`run_ranks` spawns the ranks, waits with a deadline and returns the ranks' JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, timeout_s: float = 30) -> Iterator[None]:
    """A gloo process group on the loopback interface for the body of the block."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """DDP-style gradient averaging across the ranks."""
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def run_ranks(worker: Callable[..., None], world: int, out_dir: Path, *args: Any,
              timeout_s: float = 120) -> list[Any]:
    """Spawn ``world`` ranks of ``worker`` and return each rank's ``rank{r}.json``."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    ctx = torch.multiprocessing.start_processes(
        worker, args=(world, free_port(), str(out_dir), *args), nprocs=world, join=False,
        start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("distributed test timed out")
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
