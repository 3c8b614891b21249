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


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(model: Any, layers: list[str], prev: list[Any] | None) -> dict[str, Any]:
    """The signals from the gathered (full) tensors: what one process holding the whole model
    measures."""
    from stability.adapters.torch_ops.signals import layer_of

    sq = dict.fromkeys(layers, 0.0)
    wsq = dict.fromkeys(layers, 0.0)
    dsq = dict.fromkeys(layers, 0.0)
    full = [_full(p.detach()).clone() for p in model.parameters()]
    for (n, p), w in zip(model.named_parameters(), full, strict=True):
        sq[layer_of(n)] += float(_full(p.grad).double().square().sum())
        wsq[layer_of(n)] += float(w.double().square().sum())
    w0sq = dict.fromkeys(layers, 0.0)  # ||w_t|| of the update w_t -> w_t+1 (now)
    if prev is not None:
        for (n, _), w, w0 in zip(model.named_parameters(), full, prev, strict=True):
            dsq[layer_of(n)] += float((w.double() - w0.double()).square().sum())
            w0sq[layer_of(n)] += float(w0.double().square().sum())
    return {"grad": [math.sqrt(sq[k]) for k in layers],
            "param": math.sqrt(sum(wsq.values())), "full": full,
            "ratio": [math.sqrt(dsq[k] / max(w0sq[k], 1e-300)) for k in layers]}


def _signals_worker(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    import json

    with process_group(rank, world, port, timeout_s=60):
        from stability.adapters.interventions import clip_gradients
        from stability.adapters.torch_ops.signals import SignalCollector

        model = _mixed_model(world) if mode == "mixed" else _fsdp_mlp(world)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        col = SignalCollector(model, update_ratio_every=1, param_norm_every=1,
                              update_ratio="exact" if mode == "exact" else "sampled")
        out: list[dict[str, Any]] = []
        prev_full = None
        for i in range(4):
            col.begin_step(i)
            # (the mixed model's replicated parts need the same batch on every rank)
            seed = i if mode == "mixed" else 100 * rank + i
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
            loss = model(x).square().mean()
            loss.backward()
            sig = col.collect(loss)
            prev_ratio = _reference(model, col.layer_names, prev_full)["ratio"]
            ref = _reference(model, col.layer_names, None)
            out.append({"grad_norm": sig.scalars["grad_norm"],
                        "layers": sig.families["grad_norm"].tolist(),
                        "param_norm": sig.scalars["param_norm"],
                        "ratio": sig.families.get("update_ratio", []).tolist()
                        if "update_ratio" in sig.families else None,
                        "ref_grad": ref["grad"], "ref_param": ref["param"],
                        "ref_ratio": prev_ratio if prev_full is not None else None})
            if i == 3:  # the clip uses the global norm: the full gradient ends at max_norm
                clip_gradients(col.params, 0.5 * sig.scalars["grad_norm"],
                               sig.scalars["grad_norm"], col.local_grads())  # (as the guard)
                out[-1]["clipped"] = math.sqrt(sum(float(_full(p.grad).double().square().sum())
                                                   for p in model.parameters()))
            col.before_step(i)
            prev_full = ref["full"]
            opt.step()
            opt.zero_grad()
            col.after_step()
        same_views = all(a.data_ptr() == p.to_local().data_ptr() if hasattr(p, "to_local")
                         else a is p for a, p in zip(col._lists.local, col.params, strict=True))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"steps": out, "same_views": same_views}, fh)
    os._exit(0)


def _mixed_model(world: int) -> Any:
    """A model with a ``Shard(0)`` parameter, a ``Replicate`` one and a plain one (every rank
    holds the whole of the last two: they must count once in the norms)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 6, bias=False)
            self.b = torch.nn.Linear(6, 3, bias=False)
            self.c = torch.nn.Linear(3, 1)
            self.a.weight = torch.nn.Parameter(distribute_tensor(self.a.weight.detach(), mesh,
                                                                 [Shard(0)]))
            self.b.weight = torch.nn.Parameter(distribute_tensor(self.b.weight.detach(), mesh,
                                                                 [Replicate()]))
            self.mesh = mesh

        def forward(self, x: Any) -> Any:
            from torch.distributed.tensor import DTensor

            h = DTensor.from_local(x, self.mesh, [Replicate()]).redistribute(
                self.mesh, [Replicate()])
            h = torch.tanh(torch.nn.functional.linear(h, self.a.weight))
            h = torch.nn.functional.linear(h, self.b.weight).full_tensor()
            return self.c(h)

    return Mixed()


@pytest.mark.parametrize("mode", ["sampled", "exact", "mixed"])
def test_sharded_signals_equal_full_model(tmp_path: Path, mode: str) -> None:
    """Each rank measures its shards and the squares are summed over the ranks: every rank
    reports the norms of the whole model (gradients per layer and global, weights, update
    ratios), clips by the global norm, and keeps measuring the live shards."""
    ranks = run_ranks(_signals_worker, 2, tmp_path, mode, timeout_s=240)
    for r in ranks:
        assert r["same_views"]
        for s in r["steps"]:
            assert s["grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in s["ref_grad"])),
                                                   rel=1e-5)
            assert s["layers"] == pytest.approx(s["ref_grad"], rel=1e-5)
            assert s["param_norm"] == pytest.approx(s["ref_param"], rel=1e-5)
        assert r["steps"][0]["ratio"] is None
        for s in r["steps"][1:]:
            tol = 1e-5 if mode != "sampled" else 1e-4  # (small tensors are sampled whole)
            assert s["ratio"] == pytest.approx(s["ref_ratio"], rel=tol)
        assert r["steps"][-1]["clipped"] == pytest.approx(0.5 * r["steps"][-1]["grad_norm"],
                                                          rel=1e-4)
    for k in ("grad_norm", "layers", "param_norm", "ratio"):
        assert [s[k] for s in ranks[0]["steps"]] == [s[k] for s in ranks[1]["steps"]]


def _refusal_worker(rank: int, world: int, port: int, out_dir: str, ckpt_dir: str) -> None:
    """Rank 1's file of the newest checkpoint is damaged: both ranks refuse it and restore
    the one before, together."""
    import json

    with process_group(rank, world, port, timeout_s=60):
        from stability.adapters.torch import TorchGuard

        model = _fsdp_mlp(world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = TorchGuard(model, opt, None, None, checkpoint_every=10, checkpoint_dir=ckpt_dir)
        at: dict[int, list[list[float]]] = {}
        for i in guard.batches(21):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1000 * rank + i))
            model(x).square().mean().backward()
            step = guard.step_count
            guard.step(None)
            at[step] = _shards(model)
        if rank == 1:  # a damaged file on one rank only
            (Path(ckpt_dir) / "step-000000020-rank1.pt").write_bytes(b"not a checkpoint")
        torch.distributed.barrier()
        ok = guard.rollback(20)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"ok": ok, "step": guard.step_count, "restored": _shards(model),
                       "at10": at[10], "ledger": _ledger(guard)}, fh)
    os._exit(0)


def test_restore_refused_on_every_rank(tmp_path: Path) -> None:
    """A checkpoint one rank cannot restore is refused by every rank (the verdict is
    all-reduced): no rank is left on other weights than the others."""
    r0, r1 = run_ranks(_refusal_worker, 2, tmp_path, str(tmp_path / "ckpt"), timeout_s=240)
    assert r0["ok"] and r1["ok"]
    assert r0["step"] == r1["step"] == 11  # both fell back to the checkpoint of step 10
    assert r0["restored"] == r0["at10"] and r1["restored"] == r1["at10"]
    assert r0["ledger"] == r1["ledger"] and 20 not in [s for s, _ in r0["ledger"]]
