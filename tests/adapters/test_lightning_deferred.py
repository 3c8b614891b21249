"""``StabilityCallback(sync="deferred")`` with real Lightning on CPU and a tiny model."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from stability.adapters.lightning import StabilityCallback  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Control  # noqa: E402

from .scripted import ScriptedMonitor, watch  # noqa: E402

torch.set_num_threads(1)


class Tiny(L.LightningModule):
    def __init__(self, nan_at: int = -1, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))
        self.nan_at, self.fused = nan_at, fused
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        if self.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.weights.append(self.net[0].weight.detach().clone())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused or None)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(n: int = 256) -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(root: Any, cbs: list[Any], steps: int = 30, **kw: Any) -> Any:
    opts: dict[str, Any] = dict(
        enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
        default_root_dir=str(root))
    opts.update(kw)
    return L.Trainer(max_steps=steps, callbacks=cbs, **opts)


def _precision(kind: str) -> dict[str, Any]:
    if kind == "fp16":  # a CPU GradScaler that overflows until its scale comes down
        from lightning.pytorch.plugins import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": "bf16-mixed"} if kind == "bf16" else {}


def _run(root: Any, sync: str, precision: str = "fp32", steps: int = 40,
         nan_at: int = -1, **kw: Any) -> dict[str, Any]:
    mon = Monitor("small")
    seen = watch(mon)
    model = Tiny(nan_at=nan_at)
    cb = StabilityCallback(mon, checkpoint_every=10, sync=sync, activations=["net.1"],
                           activation_every=3, clip_norm=3.0, **kw)
    tr = _trainer(root, [cb], steps=steps, **_precision(precision))
    tr.fit(model, _loader())
    return {"seen": seen, "cb": cb, "tr": tr, "model": model, "mon": mon,
            "weights": [p.detach().clone() for p in model.parameters()],
            "ledger": [(r.step, r.healthy, r.reason) for r in mon.checkpoints.records],
            "events": [(i.step, i.type, i.reason) for i in cb.guard.interventions]}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_healthy_run_is_the_step_mode_run(tmp_path: Any, precision: str) -> None:
    a = _run(tmp_path / "a", "step", precision)
    b = _run(tmp_path / "b", "deferred", precision)
    assert b["cb"].guard.deferred is not None and a["cb"].guard.deferred is None
    assert [s for s, _, _ in a["seen"]] == list(range(40))
    assert b["seen"] == a["seen"]  # the same signal stream (families included), same order
    assert any("act_mean" in f for _, _, f in a["seen"])
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        assert torch.equal(wa, wb)  # clipped on the device at clip_norm: the same bits
    norms = [m["grad_norm"] for _, m, _ in a["seen"] if "grad_norm" in m]
    assert min(norms) < 3.0 < max(norms)  # the clip bound on some steps, not on others
    assert b["ledger"] == a["ledger"] == [(29, True, "periodic"), (39, True, "periodic")]
    assert b["events"] == a["events"]
    ga, gb = a["cb"].guard, b["cb"].guard
    assert gb.step_count == ga.step_count == 40 and gb.voided_steps == 0
    if precision == "fp16":  # overflow steps: skipped by the scaler, information only
        over = [s for s, m, _ in a["seen"] if m.get("amp_overflow") == 1.0]
        assert len(over) >= 3 and gb.amp_overflows == ga.amp_overflows == len(over)
        assert gb.scaler is not None


def test_sync_argument_is_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"'sync' parameter of StabilityCallback must be one of "
                                         r"\('auto', 'step', 'deferred'\)"):
        StabilityCallback(Monitor("small"), sync="async")
    cb = StabilityCallback(ScriptedMonitor({}), checkpoint_every=0)
    assert cb.sync == "auto"  # the default, resolved when the guard is built
    _trainer(tmp_path, [cb], steps=3).fit(Tiny(fused=True), _loader())
    g = cb.guard
    assert g.sync_requested == "auto" and g.sync_mode == "step" and g.deferred is None  # CPU
    assert g.monitor.seen == [0, 1, 2]


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_nan_gradient_never_reaches_the_weights(tmp_path: Any, fused: bool) -> None:
    model = Tiny(nan_at=45, fused=fused)
    cb = StabilityCallback(Monitor("small"), checkpoint_every=10, sync="deferred")
    tr = _trainer(tmp_path, [cb], steps=60)
    tr.fit(model, _loader())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert tr.global_step == 60 and cb.stopped is None
    assert any(i.step == 45 for i in cb.guard.interventions)  # observed during step 46
    if fused:  # the fused kernel skipped the update on the device
        assert torch.equal(model.weights[45], model.weights[46])
    unguarded = Tiny(nan_at=45, fused=fused)
    _trainer(tmp_path / "off", [], steps=60).fit(unguarded, _loader())
    assert not all(torch.isfinite(p).all() for p in unguarded.parameters())


def test_late_rollback_voids_the_next_step(tmp_path: Any) -> None:
    mon = ScriptedMonitor({6: Control(rollback_to=3, skip_batches=(5, 6))})
    model = Tiny()
    cb = StabilityCallback(mon, checkpoint_every=2, sync="deferred")
    tr = _trainer(tmp_path, [cb], steps=12)
    tr.fit(model, _loader())
    g = cb.guard
    # step 7 voided; the 4 steps lost and voided are given back, the last one flushed
    assert mon.seen == [*range(7), *range(4, 12)]
    assert g.rollbacks == 1 and g.steps_lost == 3 and g.voided_steps == 1
    # the lost and the voided steps are given back (extend_max_steps): 12 healthy steps
    assert tr.global_step == 16 == g.step_count + g.steps_lost + g.voided_steps
    assert torch.equal(model.weights[4], model.weights[8])  # weights after step 3 restored
    assert cb.cancelled_saves == [8]  # the save due right after the rollback


def test_late_emergency_checkpoint(tmp_path: Any) -> None:
    mon = ScriptedMonitor({3: Control(save_checkpoint=True, checkpoint_reason="scripted")})
    cb = StabilityCallback(mon, checkpoint_every=0, sync="deferred", in_memory=True)
    _trainer(tmp_path, [cb], steps=8).fit(Tiny(), _loader())
    # observed during step 4, written by Lightning at its end (never an in-memory copy)
    path = tmp_path / "stability-checkpoints" / "emergency-step=4.ckpt"
    assert path.exists() and cb.store.memory_bytes() == 0
    assert not cb.store.entries[4].healthy and cb.store.entries[4].reason == "emergency: scripted"


@pytest.mark.parametrize("resume_sync", ["deferred", "step"])
def test_resume_with_a_pending_step(tmp_path: Any, resume_sync: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root: Any, steps: int, ckpt: str | None = None, sync: str = "deferred") -> Any:
        mon = Monitor("small")
        seen = watch(mon)
        cb = StabilityCallback(mon, checkpoint_every=10, sync=sync)
        saver = ModelCheckpoint(dirpath=str(root), every_n_train_steps=32, save_top_k=-1,
                                filename="{step}")
        tr = _trainer(root, [cb, saver], steps=steps, enable_checkpointing=True)
        tr.fit(Tiny(nan_at=50), _loader(), ckpt_path=ckpt)
        return cb, seen, tr

    ref, seen_ref, _ = run(tmp_path / "a", 64)
    (ck,) = (tmp_path / "a").glob("step=32*.ckpt")
    saved = torch.load(ck, weights_only=False)["callbacks"][ref.state_key]["guard"]
    assert saved["step"] == 32 and saved["deferred"]["pending"]["step"] == 31
    assert saved["monitor"]["last_step"] == 30  # step 31 travels unobserved
    cb, seen, tr = run(tmp_path / "b", 64, str(ck), resume_sync)
    assert [s for s, _, _ in seen] == list(range(31, 64))  # the pending step first, once
    assert seen[0] == seen_ref[31]
    assert cb.guard.sync_mode == resume_sync
    events = [(i.step, i.type, i.reason) for i in cb.guard.interventions]
    if resume_sync == "step":  # the first step ran the deferred way, then step mode
        assert cb.guard.deferred is None and (50, "skip_step") in [e[:2] for e in events]
        assert tr.global_step == 64 and cb.guard.step_count == ref.guard.step_count
        return
    assert events and events == [(i.step, i.type, i.reason) for i in ref.guard.interventions
                                  if i.step >= 31]
    assert tr.global_step == 64 and cb.guard.step_count == ref.guard.step_count


@pytest.mark.parametrize("sync", ["step", "deferred"])
def test_no_host_sync_in_the_step_hooks(tmp_path: Any, sync: str) -> None:
    from tests.adapters.test_guard_deferred import _Syncs
    from tests.adapters.test_hf_deferred import _count_syncs_in

    cb = StabilityCallback(Monitor("small"), checkpoint_every=0, sync=sync,
                           activations=["net.1"], activation_every=2)
    hooks = ("on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
    with _Syncs().installed() as syncs:
        per = _count_syncs_in(cb, hooks, syncs)
        _trainer(tmp_path, [cb], steps=12).fit(Tiny(fused=True), _loader())
    steady = slice(2, None)  # (the first steps allocate the reused host buffers)
    if sync == "step":
        assert min(per["on_before_optimizer_step"][steady]) >= 1
    else:
        for h in hooks:
            assert per[h][steady] == [0] * 10, h
    assert cb.guard.step_count == 12


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    import json
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0",
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", RANK=str(rank))
    torch.set_num_threads(1)
    mon = Monitor("small")
    cb = StabilityCallback(mon, checkpoint_every=10, sync="deferred", log_metrics=False)
    model = Tiny(nan_at=25 if rank == 1 else -1)  # (DDP averages the NaN into both ranks)
    tr = _trainer(out_dir, [cb], steps=40, devices=2, strategy="ddp")
    log: list[Any] = []
    orig = cb.on_train_batch_end

    def spy(*a: Any, **k: Any) -> None:
        orig(*a, **k)
        g = cb.guard
        log.append([tr.global_step, g.step_count, g.control.to_dict(), g.healthy])

    cb.on_train_batch_end = spy  # type: ignore[method-assign]
    tr.fit(model, _loader())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"log": log, "events": [[i.step, i.type] for i in cb.guard.interventions],
                   "w": [p.detach().tolist() for p in model.parameters()],
                   "ledger": [r.step for r in mon.checkpoints.records],
                   "synced": cb.guard.sync is not None and tr.world_size == 2}, fh)
    os._exit(0)  # (see tests/adapters/test_distributed.py: torch's gloo teardown)


def test_ddp_ranks_take_the_same_late_decisions(tmp_path: Any) -> None:
    import json
    import socket
    import time

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = torch.multiprocessing.start_processes(_ddp_worker, args=(port, str(tmp_path)),
                                                nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("distributed test timed out")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["synced"] and r1["synced"]  # decisions reduced across the two ranks
    assert r0["log"] == r1["log"] and len(r0["log"]) == 40  # same decisions, same steps
    assert r0["events"] == r1["events"] and any(s == 25 for s, _ in r0["events"])
    assert r0["w"] == r1["w"] and r0["ledger"] == r1["ledger"]
    assert all(torch.isfinite(torch.tensor(w)).all() for w in r0["w"])
