"""Mixed precision: GradScaler overflow steps are information, not NaN faults (real torch, CPU)."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.amp import (  # noqa: E402
    amp_metrics,
    amp_state,
    autocast_dtype,
    drop_grad_norms,
    ensure_unscaled,
    found_inf,
    loss_scale,
    scaler_enabled,
)
from stability.monitor.monitor import Monitor  # noqa: E402


class _Rec:
    """Recorder: keeps what the guard sends to the monitor, per step."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows[step] = dict(metrics)


def _data(n: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x[:, :1] * 2.0 - x[:, 1:2] + 0.05 * torch.randn(n, 1, generator=g)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _run(n_steps: int, *, precision: str = "fp16", init_scale: float = 2.0**40,
         bad_grads_from: int | None = None, nan_loss_at: int | None = None,
         monitor: Monitor | None = None):
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if precision == "fp16" else None
    rec = _Rec()
    mon = monitor if monitor is not None else Monitor("small")
    guard = TorchGuard(model, opt, sched, mon, scaler=scaler, recorder=rec, checkpoint_every=20,
                       raise_on_stop=False, log_interventions=False)
    x, y = _data()
    dtype = autocast_dtype(precision)
    decisions = []
    for i in range(n_steps):
        xb, yb = x[(i * 32) % 2048:][:32], y[(i * 32) % 2048:][:32]
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
        if nan_loss_at is not None and i == nan_loss_at:
            loss = loss * float("nan")
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if bad_grads_from is not None and i >= bad_grads_from:
            model[0].weight.grad[0, 0] = float("inf")  # a layer overflowing every step
        decisions.append(guard.step(loss))
        if guard.stopped is not None:
            break
    return guard, scaler, rec, decisions, mon


def test_helpers_without_scaler() -> None:
    assert not scaler_enabled(None)
    assert not scaler_enabled(torch.amp.GradScaler("cpu", enabled=False))
    assert amp_state(None) == (False, amp_state(None)[1]) and math.isnan(amp_state(None)[1])
    assert math.isnan(loss_scale(None))
    assert amp_metrics(False, math.nan) == {}
    assert drop_grad_norms({"grad_norm": math.inf, "grad_norm/a": 1.0, "loss": 1.0}, False) == {
        "grad_norm": math.inf, "grad_norm/a": 1.0, "loss": 1.0}
    assert drop_grad_norms({"grad_norm": math.inf, "grad_norm/a": 1.0, "grad_normx": 2.0}, True
                           ) == {"grad_normx": 2.0}
    assert autocast_dtype("fp32") is None and autocast_dtype("bf16-mixed") is torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        autocast_dtype("fp8")


def test_amp_state_reads_a_real_scaler() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = _data(64)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    assert found_inf(scaler, opt) is None  # nothing recorded before unscale_
    assert ensure_unscaled(scaler, opt)
    assert ensure_unscaled(scaler, opt)  # a second call is harmless
    overflow, scale = amp_state(scaler, opt)
    assert overflow and scale == 2.0**40
    scaler.step(opt)
    scaler.update()
    assert found_inf(scaler, opt) is None  # update() reset the record
    assert amp_state(scaler, opt, prev_scale=2.0**40) == (True, 2.0**39)
    assert amp_state(scaler, opt, prev_scale=2.0**39) == (False, 2.0**39)


def test_startup_overflows_are_not_faults() -> None:
    guard, scaler, rec, decisions, mon = _run(80)
    overflow_steps = [s for s, r in rec.rows.items() if r.get("amp_overflow") == 1.0]
    assert len(overflow_steps) >= 10  # 2**40 must come down to fp16's range
    assert guard.amp_overflows == len(overflow_steps)
    for s in overflow_steps:  # non-finite grad norms are missing, not NaN
        assert not any(k == "grad_norm" or k.startswith("grad_norm/") for k in rec.rows[s])
        assert math.isfinite(rec.rows[s]["loss_scale"])
    normal = [s for s in rec.rows if s not in overflow_steps]
    assert normal and all(math.isfinite(rec.rows[s]["grad_norm"]) for s in normal)
    assert all(rec.rows[s]["amp_overflow"] == 0.0 for s in normal)
    assert mon.counters["alarms"] == 0
    assert [iv for d in decisions for iv in d.interventions] == []
    assert guard.stopped is None and guard.steps_skipped == 0
    assert scaler.get_scale() < 2.0**40


def test_grad_norms_are_unscaled() -> None:
    # no overflow at a small scale: the measured norm is the true (unscaled) one
    guard, _, rec, _, _ = _run(1, init_scale=2.0**10)
    ref_model = _model()
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(ref_model(x[:32]).float(), y[:32])
    loss.backward()
    ref = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()]).item()
    assert rec.rows[0]["amp_overflow"] == 0.0 and rec.rows[0]["loss_scale"] == 2.0**10
    assert rec.rows[0]["grad_norm"] == pytest.approx(ref, rel=1e-2)


def test_frequent_overflows_alarm_without_nonfinite() -> None:
    guard, scaler, rec, decisions, mon = _run(120, init_scale=2.0**12, bad_grads_from=70)
    alarms = [a for d in decisions for a in d.alarms]
    assert alarms, "persistent overflows must alarm"
    assert {a.detector for a in alarms} <= {"amp_overflow", "loss_scale_collapse"}
    assert all(a.kind == "grad_explosion" for a in alarms)
    first = min(i for i, d in enumerate(decisions) if d.alarms)  # iteration (rollbacks rewind)
    assert 70 < first <= 85  # within ~a dozen overflow steps
    assert not any(a.kind == "nonfinite" for a in alarms)


def test_nonfinite_loss_is_still_a_fault() -> None:
    guard, scaler, rec, decisions, mon = _run(60, init_scale=2.0**12, nan_loss_at=50)
    kinds = {(a.kind, a.signal) for a in decisions[50].alarms}
    assert ("nonfinite", "loss") in kinds
    assert any(iv.type == "skip_step" for iv in decisions[50].interventions)


def test_bf16_autocast_needs_no_scaler() -> None:
    guard, scaler, rec, decisions, mon = _run(60, precision="bf16")
    assert scaler is None and guard.scaler is None
    assert all("amp_overflow" not in r and "loss_scale" not in r for r in rec.rows.values())
    assert mon.counters["alarms"] == 0
    assert all(math.isfinite(r["grad_norm"]) for r in rec.rows.values())


def test_monitor_skip_on_overflow_step_keeps_the_scaler_consistent() -> None:
    # the monitor asks to skip while the scaler overflows: update() must still run
    from stability.types import Control, Decision

    class _SkipAll:
        def observe(self, step: int, metrics=None, families=None) -> Decision:
            return Decision(step, control=Control(skip_step=True))

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    guard = TorchGuard(model, opt, None, _SkipAll(), scaler=scaler, checkpoint_every=0)
    x, y = _data(64)
    w0 = model[0].weight.detach().clone()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        guard.step(loss)
    assert torch.equal(model[0].weight, w0)
    assert scaler.get_scale() == 2.0**37  # three overflows, three halvings
    assert guard.steps_skipped == 3 and guard.amp_overflows == 3


def test_scaler_without_found_inf_record_falls_back_to_the_grad_norm() -> None:
    class _Opaque(torch.amp.GradScaler):
        def _found_inf_per_device(self, optimizer):
            raise AttributeError("no record here")

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _Opaque("cpu", init_scale=2.0**40)
    rec = _Rec()
    guard = TorchGuard(model, opt, None, Monitor("small"), scaler=scaler, recorder=rec,
                       checkpoint_every=0)
    x, y = _data(64)
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        d = guard.step(loss)
        assert not d.alarms
    assert [r["amp_overflow"] for r in rec.rows.values()] == [1.0, 1.0, 1.0]
    assert all("grad_norm" not in r for r in rec.rows.values())


def _scaler_stream(n: int, overflow: Any) -> list[dict[str, float]]:
    """What a GradScaler reports: halve on overflow, double after 200 clean steps."""
    scale, clean, out = 2.0**16, 0, []
    for t in range(n):
        o = bool(overflow(t))
        out.append({"loss": 1.0, "amp_overflow": float(o), "loss_scale": scale})
        if o:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == 200:
                scale, clean = scale * 2, 0
    return out


@pytest.mark.parametrize("preset", ["default", "small", "llm_pretrain", "finetune"])
def test_preset_bindings_tolerate_routine_overflows(preset: str) -> None:
    # start-up halvings, then the overflow that follows every growth interval
    stream = _scaler_stream(3000, lambda t: t < 6 or (t > 6 and t % 201 == 0))
    mon = Monitor(preset, alert_sinks=[])
    alarms = [a for t, m in enumerate(stream) for a in mon.observe(t, m).alarms]
    assert alarms == []


@pytest.mark.parametrize(("rate", "within"), [(1.0, 15), (0.3, 60)])
def test_preset_bindings_alarm_on_frequent_overflows(rate: float, within: int) -> None:
    import random

    rnd = random.Random(0)
    stream = _scaler_stream(1500, lambda t: t < 4 or (t >= 1000 and rnd.random() < rate))
    mon = Monitor("default", alert_sinks=[])
    first = next((t for t, m in enumerate(stream) if mon.observe(t, m).alarms), None)
    assert first is not None and 1000 <= first < 1000 + within
