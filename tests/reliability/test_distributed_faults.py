"""Distributed faults with 2 gloo ranks (CPU): decisions stay identical, nothing hangs.

Each rank runs its own monitor on its local signals and reduces the step's ``Control`` with
:class:`stability.adapters.distributed.ControlSync`.  Faults: a NaN and a spike only rank 1 sees,
rank 0 slow on some steps, a handler that raises on rank 1.  Every rank writes the reduced
decision of every step; the files must be identical.  A rank that disappears makes the other
fail within the process-group timeout instead of hanging.

Ranks are forked from the warm test process (a spawned interpreter costs its whole import time);
every wait is bounded.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()"),
]

N_STEPS = 80
PG_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 90.0
CONFIG = {"detectors": [
    {"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"], "kind": "nonfinite"},
    {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"], "kind": "loss_spike",
     "params": {"warmup": 10, "alpha": 0.1}},
]}


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _rank_main(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    from stability.adapters.distributed import ControlSync
    from stability.monitor.monitor import Monitor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    lines = []
    try:
        def broken(item: Any) -> None:
            raise RuntimeError("handler bug on rank 1")

        mon = Monitor(CONFIG, on_alarm=broken if rank == 1 else None)
        sync = ControlSync()
        for s in range(N_STEPS):
            if scenario == "rank_dies" and rank == 1 and s == 30:
                os._exit(3)  # gone without a word: no destroy_process_group
            loss = 2.0 + 0.01 * math.sin(s)
            if rank == 1 and s == 25:
                loss = math.nan
            if rank == 1 and s == 50:
                loss = 40.0
            if rank == 0 and s % 20 == 0:
                time.sleep(0.2)  # the slow rank
            d = mon.observe(s, {"loss": loss})
            control, any_alarm = sync.reduce(d.control, s, bool(d.alarms))
            lines.append(json.dumps({"step": s, "alarm": any_alarm, "control": control.to_dict()},
                                    sort_keys=True))
        Path(out).write_text("\n".join(lines) + "\n")
        dist.barrier()
    except Exception as e:  # report how this rank failed, for the parent to check
        Path(out + ".error").write_text(f"{type(e).__name__}: {e}")
        os._exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # skip C++ static destructors: torch's gloo teardown can abort at exit


def _launch(tmp: Path, scenario: str) -> tuple[list[int | None], float]:
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(tmp / f"rank{r}.jsonl"),
                                                  scenario)) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"{len(hung)} rank(s) still running after {JOIN_TIMEOUT_S} s"
    return [p.exitcode for p in procs], time.monotonic() - t0


def test_local_faults_give_identical_decisions(tmp_path: Path) -> None:
    codes, _ = _launch(tmp_path, "faults")
    errors = [(tmp_path / f"rank{r}.jsonl.error") for r in range(2)]
    assert codes == [0, 0], [e.read_text() for e in errors if e.exists()]
    r0 = (tmp_path / "rank0.jsonl").read_text().splitlines()
    r1 = (tmp_path / "rank1.jsonl").read_text().splitlines()
    assert len(r0) == N_STEPS and r0 == r1
    rows = [json.loads(x) for x in r0]
    assert rows[25]["alarm"] and rows[25]["control"]["skip_step"], "rank 1's NaN not acted on"
    assert rows[50]["alarm"], "rank 1's spike not seen by rank 0"


def test_a_vanished_rank_fails_the_other_within_the_timeout(tmp_path: Path) -> None:
    codes, elapsed = _launch(tmp_path, "rank_dies")
    assert codes[1] == 3
    assert codes[0] == 2, "the surviving rank should fail (not hang, not succeed)"
    err = (tmp_path / "rank0.jsonl.error").read_text()
    assert err, "surviving rank did not report its failure"
