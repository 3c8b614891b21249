"""Sharded training (FSDP2 ``fully_shard``) on two gloo ranks on CPU.

Every rank holds half of each weight (a ``DTensor`` shard), the guard runs on each rank:

* a fault seen by one rank only (its loss is NaN) gives the same decision at the same step on
  both ranks;
* a save of bad weights (one rank's shard corrupted to NaN just before a scheduled checkpoint)
  is refused on both ranks -- the checkpoint ledgers stay identical, step for step and flag for
  flag;
* a rollback restores every shard: each rank's local shard equals what it held at the restored
  checkpoint, and the shards that two ranks hold are the same model as before.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)

from tests.adapters.gloo import process_group, run_ranks  # noqa: E402

STEPS = 80
NAN_LOSS = 30  #: rank 1's loss is NaN at this step
BAD_SAVE = 49  #: rank 1's shard is NaN from this step's forward on (a checkpoint is due at 49;
#: the policy's skip / rollback to a healthy checkpoint repairs it)
ROLLBACK = 70  #: both ranks roll back to the checkpoint of step 59 here


def _shards(model: Any) -> list[list[float]]:
    return [p.to_local().detach().flatten().tolist() for p in model.parameters()]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json

    with process_group(rank, world, port, timeout_s=60):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from stability.adapters.torch import TorchGuard
        from stability.monitor.monitor import Monitor

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=10)
        log: list[list[Any]] = []
        saved: dict[int, list[list[float]]] = {}
        restored: list[list[float]] = []
        for i in guard.batches(STEPS):
            step = guard.step_count
            if rank == 1 and step == BAD_SAVE:
                with torch.no_grad():
                    next(model.parameters()).to_local().fill_(math.nan)  # this rank's shard
            g = torch.Generator().manual_seed(1000 * rank + i)
            x = torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            if rank == 1 and step == NAN_LOSS:
                loss = loss * float("nan")  # only rank 1 sees it
            loss.backward()  # FSDP reduce-scatters the gradients: each rank gets its shard's
            guard.step(loss)
            c = guard.control
            log.append([step, c.skip_step, c.rollback_to, c.stop, guard.healthy])
            if step == 59:
                saved[59] = _shards(model)
            if step == ROLLBACK:
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(3.0)  # wreck every shard, then roll back
                ok = guard.rollback(59)
                restored = _shards(model) if ok else []
        ledger = sorted((int(s), bool(r.healthy)) for s, r in guard.ledger.entries.items())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"log": log, "ledger": ledger, "saved59": saved.get(59),
                       "restored": restored, "final": _shards(model),
                       "rollbacks": guard.rollbacks}, fh)
    os._exit(0)


#: what stops the guard on FSDP2 today (torch 2.13, CPU/gloo): its signal collector computes the
#: per-layer gradient norms with ``index_add_`` over plain tensors, and FSDP2's gradients are
#: ``DTensor`` shards ("aten.index_add_.default got mixed torch.Tensor and DTensor").  Taking
#: ``to_local()`` alone is not the fix: each rank would then see (and clip by) its own shard's
#: norm, so the squared layer norms must be all-reduced over the shard group first.
FSDP_GAP = ("TorchGuard's signal collector does not handle DTensor (FSDP2) gradients yet: "
            "mixed torch.Tensor and DTensor in index_add_")


@pytest.mark.xfail(strict=True, reason=FSDP_GAP)
def test_fsdp_two_gloo_ranks(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_worker, 2, tmp_path, timeout_s=240)
    # every rank takes the same decision at the same step
    assert r0["log"] == r1["log"]
    row = next(r for r in r0["log"] if r[0] == NAN_LOSS)
    assert row[1] is True and row[4] is False  # skipped and unhealthy on rank 0 as well
    # a save of bad weights is refused on all ranks or none
    assert r0["ledger"] == r1["ledger"]
    bad = next(r for r in r0["log"] if r[0] == BAD_SAVE)
    assert bad[4] is False  # the NaN shard made the step unhealthy on both ranks
    assert (BAD_SAVE, True) not in [tuple(e) for e in r0["ledger"]]
    # a rollback restores every shard
    for r in (r0, r1):
        assert r["saved59"] is not None and r["restored"] == r["saved59"]
    assert r0["saved59"] != r1["saved59"]  # two different halves of the model


def test_fsdp2_trains_on_cpu_gloo(tmp_path: Path) -> None:
    """The premise of the test above: FSDP2 itself runs on CPU/gloo with this torch."""
    out = run_ranks(_plain_worker, 2, tmp_path, timeout_s=240)
    assert out[0]["loss"] == out[1]["loss"] and math.isfinite(out[0]["loss"])
    assert out[0]["placement"] in ("S(0)", "Shard(dim=0)") and out[0]["local"] != out[1]["local"]


def _plain_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json

    with process_group(rank, world, port, timeout_s=60):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(5):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            opt.step()
            opt.zero_grad()
        p = next(model.parameters())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"loss": loss.item(), "placement": str(p.placements[0]),
                       "local": p.to_local().flatten().tolist()}, fh)
    os._exit(0)
