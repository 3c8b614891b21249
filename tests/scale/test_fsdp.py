"""Sharded training (FSDP2 ``fully_shard``) with the guard on two gloo ranks on CPU.

Every rank holds half of each weight (a ``DTensor`` shard), the guard runs on each rank:

* a fault seen by one rank only (its loss is NaN) gives the same decision at the same step on
  both ranks;
* a save of bad weights (one rank's shard corrupted to NaN by the update of a step whose
  checkpoint is due, after the monitor judged the step healthy) is refused on both ranks -- the
  checkpoint ledgers stay identical, step for step and flag for flag;
* a rollback restores every shard: each rank's local shard equals what it held at the restored
  checkpoint, and the shards that two ranks hold are the same model as before.

Each fault happens once (the first time the run reaches its step; a rollback replays the steps
after its checkpoint without it).  ``test_sharded_signals_equal_full_model`` checks the
measurements themselves against the full (gathered) tensors.
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
BAD_SAVE = 50  #: rank 1's shard turns NaN in this step's update; its checkpoint is due
SAVED = 60  #: the checkpoint a manual rollback restores ...
ROLLBACK = 70  #: ... at this step, after every shard was wrecked


def _shards(model: Any) -> list[list[float]]:
    return [p.to_local().detach().flatten().tolist() for p in model.parameters()]


def _fsdp_mlp(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, world: int, port: int, out_dir: str, ckpt_dir: str | None) -> None:
    import json

    with process_group(rank, world, port, timeout_s=60):
        from stability.adapters.torch import TorchGuard
        from stability.monitor.monitor import Monitor

        model = _fsdp_mlp(world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=10,
                           checkpoint_dir=ckpt_dir)
        first = next(model.parameters())
        faults: set[str] = set()

        def corrupt(*_: Any) -> None:  # rank 1's shard turns NaN in the update of BAD_SAVE
            if rank == 1 and guard.step_count == BAD_SAVE and "save" not in faults:
                faults.add("save")
                with torch.no_grad():
                    first.to_local().fill_(math.nan)

        opt.register_step_post_hook(corrupt)
        log: list[list[Any]] = []
        ledger_after_bad: list[Any] = []
        saved: list[list[float]] = []
        restored: list[list[float]] = []
        for i in guard.batches(STEPS):
            step = guard.step_count
            g = torch.Generator().manual_seed(1000 * rank + i)
            x = torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            if rank == 1 and step == NAN_LOSS and "loss" not in faults:
                faults.add("loss")
                loss = loss * float("nan")  # only rank 1 sees it
            loss.backward()  # FSDP reduce-scatters the gradients: each rank gets its shard's
            guard.step(loss)
            c = guard.control
            log.append([step, c.skip_step, c.rollback_to, c.stop, guard.healthy])
            if step == BAD_SAVE and not ledger_after_bad:
                ledger_after_bad = _ledger(guard)
            if step == SAVED:
                saved = _shards(model)
            if step == ROLLBACK and "rollback" not in faults:
                faults.add("rollback")
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(3.0)  # wreck every shard, then roll back
                ok = guard.rollback(SAVED)
                restored = _shards(model) if ok else []
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"log": log, "ledger": _ledger(guard), "bad": ledger_after_bad,
                       "saved": saved, "restored": restored, "final": _shards(model),
                       "rollbacks": guard.rollbacks}, fh)
    os._exit(0)


def _ledger(guard: Any) -> list[list[Any]]:
    return [[int(s), bool(r.healthy)] for s, r in sorted(guard.store.entries.items())]


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "files"])
def test_fsdp_two_gloo_ranks(tmp_path: Path, on_disk: bool) -> None:
    ckpt = str(tmp_path / "ckpt") if on_disk else None
    r0, r1 = run_ranks(_worker, 2, tmp_path, ckpt, timeout_s=240)
    # every rank takes the same decision at the same step
    assert r0["log"] == r1["log"]
    row = next(r for r in r0["log"] if r[0] == NAN_LOSS)
    assert row[1] is True and row[4] is False  # skipped and unhealthy on rank 0 as well
    # a save of bad weights is refused on all ranks or none
    assert r0["ledger"] == r1["ledger"] and r0["bad"] == r1["bad"]
    assert next(r for r in r0["log"] if r[0] == BAD_SAVE)[4] is True  # judged healthy ...
    assert BAD_SAVE - 10 in [s for s, _ in r0["bad"]]  # ... the previous one was saved ...
    assert BAD_SAVE not in [s for s, _ in r0["bad"]]  # ... this one refused on both ranks
    after = [r for r in r0["log"] if r[0] == BAD_SAVE + 1]
    assert after[0][2] is not None or after[0][1]  # the NaN shard is acted on, on both ranks
    assert r0["rollbacks"] == r1["rollbacks"] >= 2  # the policy's and the manual one
    # a rollback restores every shard
    for r in (r0, r1):
        assert r["saved"] and r["restored"] == r["saved"]
        assert all(math.isfinite(v) for shard in r["final"] for v in shard)
    assert r0["saved"] != r1["saved"]  # two different halves of the model
    if on_disk:
        names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert any(n.endswith("-rank0.pt") for n in names)
        assert any(n.endswith("-rank1.pt") for n in names)


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
