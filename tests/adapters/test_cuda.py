"""The guard on a real CUDA device: mixed precision, interventions, rollback, checkpoints, syncs.

Skipped where no GPU is present (CI has none); run on a machine with one::

    python -m pytest tests/adapters/test_cuda.py

The same runs as the CPU tests, moved to the GPU with ``train_run(device="cuda")``: batches
are made on the CPU and moved, autocast and the GradScaler are CUDA's.
"""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.testing.tinytrain import FaultSpec, train_run  # noqa: E402


def _acting(res) -> list:
    return res.acting_interventions()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_healthy_gpu_run_is_never_touched(precision: str) -> None:
    seen: list = []
    res = train_run("gpt", 150, seed=0, precision=precision, device="cuda",
                    monitor=Monitor("small", alert_sinks=[], on_alarm=seen.append))
    bare = train_run("gpt", 150, seed=0, precision=precision, device="cuda")
    assert _acting(res) == []
    assert res.rollbacks == 0 and res.stopped is None
    assert math.isfinite(res.final_loss)
    assert res.final_loss <= 1.02 * bare.final_loss


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_lr_blowup_on_the_gpu_is_rescued(precision: str) -> None:
    fault = FaultSpec("lr_blowup", 60, duration=10, magnitude=100.0)
    clean = train_run("gpt", 150, seed=1, precision=precision, device="cuda")
    broken = train_run("gpt", 150, seed=1, precision=precision, device="cuda", fault=fault)
    saved = train_run("gpt", 150, seed=1, precision=precision, device="cuda", fault=fault,
                      monitor=Monitor("small", alert_sinks=[]))
    assert broken.final_loss > 1.05 * clean.final_loss  # the fault really hurts
    assert any(i.type == "reduce_lr" for i in _acting(saved))
    assert saved.final_loss <= 1.05 * clean.final_loss


def test_a_bit_flip_on_the_gpu_rolls_back_to_cuda_weights() -> None:
    fault = FaultSpec("bit_flip", 80, duration=1, magnitude=30)
    res = train_run("mlp", 200, seed=0, device="cuda", fault=fault,
                    monitor=Monitor("small", alert_sinks=[]))
    assert res.rollbacks >= 1
    assert math.isfinite(res.final_loss)
    clean = train_run("mlp", 200, seed=0, device="cuda")
    assert res.final_loss <= 1.05 * clean.final_loss


def test_a_nan_gradient_is_skipped_and_checkpoints_round_trip_on_disk(tmp_path) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = TorchGuard(model, opt, monitor=Monitor("small", alert_sinks=[]), sync="step",
                       checkpoint_dir=tmp_path, checkpoint_every=5, log_interventions=False)
    x = torch.randn(64, 16, device=dev)
    y = torch.randn(64, 1, device=dev)
    for i in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i == 20:
            next(model.parameters()).grad[0, 0] = float("nan")
            before = [p.detach().clone() for p in model.parameters()]
        d = guard.step(loss)
        if i == 20:
            assert d.control.skip_step
            after = list(model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        if i == 25:  # a periodic checkpoint (every 5 healthy steps) is written after this step
            at25 = [p.detach().clone() for p in model.parameters()]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(p.device.type == "cuda" for p in model.parameters())
    state = guard.state_dict()
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                 torch.nn.Linear(32, 1)).to(dev)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    guard2 = TorchGuard(model2, opt2, monitor=Monitor("small", alert_sinks=[]), sync="step",
                        checkpoint_dir=tmp_path, checkpoint_every=5, log_interventions=False)
    guard2.load_state_dict(state)  # resume in a "new process": the ledger reads the disk
    assert guard2.step_count == guard.step_count
    assert guard2.rollback(29)  # restores the newest healthy checkpoint from disk, onto the GPU
    assert guard2.step_count == 26
    for p, q in zip(model2.parameters(), at25, strict=True):
        assert p.device.type == "cuda"
        assert torch.equal(p.detach(), q)


def test_the_guard_adds_at_most_one_host_sync_per_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = TorchGuard(model, opt, monitor=Monitor("default", alert_sinks=[]), sync="step",
                       log_interventions=False, checkpoint_every=0)
    assert max(_syncs_in_guard_steps(guard, model)) <= 1


@pytest.mark.parametrize("fused", [True, False])
def test_auto_is_deferred_on_the_gpu_with_a_fused_optimizer(fused: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    guard = TorchGuard(model, opt, monitor=Monitor("default", alert_sinks=[]),
                       log_interventions=False, checkpoint_every=0)
    model.to("cuda")  # moved after the guard was built: resolved at the first step
    assert guard.sync_mode == "auto"
    syncs = _syncs_in_guard_steps(guard, model)
    assert guard.sync_mode == ("deferred" if fused else "step")
    assert guard.state_dict()["sync"] == guard.sync_mode
    if fused:
        assert max(syncs) == 0 and guard.deferred is not None
    else:
        assert guard.deferred is None and min(syncs) >= 1 and max(syncs) <= 1
    guard.flush()


def _syncs_in_guard_steps(guard: TorchGuard, model, opt_steps: int = 8) -> list[int]:
    x = torch.randn(32, 64, device="cuda")
    counts = []
    for i in range(opt_steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                guard.step(loss)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if i >= 3:
            counts.append(sum("synchroniz" in str(m.message) for m in w))
    return counts


def test_deferred_mode_steps_without_a_host_sync_on_the_gpu() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64)).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = TorchGuard(model, opt, monitor=Monitor("default", alert_sinks=[]), sync="deferred",
                       log_interventions=False, checkpoint_every=0)
    assert max(_syncs_in_guard_steps(guard, model)) == 0
    guard.flush()


@pytest.mark.parametrize("fused", [True, False])
def test_deferred_mode_keeps_nan_gradients_out_of_the_gpu_weights(fused: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1)).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    guard = TorchGuard(model, opt, monitor=Monitor("small", alert_sinks=[]), sync="deferred",
                       log_interventions=False)
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 1, device="cuda")
    for i in range(40):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i == 30:
            next(model.parameters()).grad[0, 0] = float("nan")
        guard.step(loss)
    guard.flush()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(i.type == "skip_step" for i in guard.interventions)


def test_deferred_mode_rescues_an_lr_blowup_on_the_gpu() -> None:
    fault = FaultSpec("lr_blowup", 60, duration=10, magnitude=100.0)
    clean = train_run("gpt", 150, seed=1, precision="bf16", device="cuda")
    saved = train_run("gpt", 150, seed=1, precision="bf16", device="cuda", fault=fault,
                      monitor=Monitor("small", alert_sinks=[]),
                      guard_kwargs={"sync": "deferred"})
    assert saved.final_loss <= 1.05 * clean.final_loss
