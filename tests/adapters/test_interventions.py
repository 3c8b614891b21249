"""LR multiplier with real schedulers, clipping, skipped steps, atomic checkpoints."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.interventions import (  # noqa: E402
    CheckpointStore,
    LRMultiplier,
    TrainingStopped,
    clip_gradients,
    drop_gradients,
    load_checkpoint,
    save_checkpoint,
)

sched_mod = torch.optim.lr_scheduler


def _make(kind: str, opt: torch.optim.Optimizer):
    if kind == "lambda":
        return sched_mod.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    if kind == "cosine_warmup":
        warm = sched_mod.LinearLR(opt, start_factor=0.1, total_iters=5)
        cos = sched_mod.CosineAnnealingLR(opt, T_max=30, eta_min=1e-3)
        return sched_mod.SequentialLR(opt, [warm, cos], milestones=[5])
    if kind == "onecycle":
        return sched_mod.OneCycleLR(opt, max_lr=0.5, total_steps=40)
    if kind == "step":  # recursive: reads the group's LR; must not compound with the factor
        return sched_mod.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "exponential":
        return sched_mod.ExponentialLR(opt, gamma=0.9)
    raise AssertionError(kind)


def _lrs_used(kind: str, factor_at: dict[int, float], n: int = 25) -> tuple[list[float], list]:
    """LR actually used by each SGD step (from the update of a parameter with grad 1)."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = _make(kind, opt)
    mult = LRMultiplier(opt)
    used, sched_lrs = [], []
    for s in range(n):
        if s in factor_at:
            mult.factor = factor_at[s]
        before = p.item()
        p.grad = torch.ones(1, dtype=torch.float64)
        opt.step()
        used.append(before - p.item())
        sched.step()
        sched_lrs.append(opt.param_groups[0]["lr"])
    mult.remove()
    return used, sched_lrs


@pytest.mark.parametrize("kind", ["lambda", "cosine_warmup", "onecycle", "step", "exponential"])
def test_lr_multiplier_survives_real_schedulers(kind: str) -> None:
    ref, ref_sched = _lrs_used(kind, {})
    got, got_sched = _lrs_used(kind, {5: 0.1, 15: 1.0})
    for s in range(25):
        f = 0.1 if 5 <= s < 15 else 1.0
        assert got[s] == pytest.approx(ref[s] * f, rel=1e-5), (kind, s)
    # the scheduler's own trajectory is untouched (no compounding for recursive schedulers)
    assert got_sched == pytest.approx(ref_sched, rel=1e-6)


def test_writing_param_groups_alone_is_undone_by_lambdalr() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = sched_mod.LambdaLR(opt, lambda s: 1.0)
    p.grad = torch.ones(1)
    opt.step()
    opt.param_groups[0]["lr"] *= 0.1  # the naive intervention
    sched.step()
    assert opt.param_groups[0]["lr"] == 1.0  # ... gone after one scheduler step


def test_lr_multiplier_idempotent_apply_and_user_changes() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    mult = LRMultiplier(opt, factor=0.5)
    mult.apply()
    mult.apply()
    assert opt.param_groups[0]["lr"] == 0.5
    mult.restore()
    opt.param_groups[0]["lr"] = 0.3  # user sets a new base between steps
    assert mult.base_lrs() == [0.3] and mult.effective_lrs() == [0.15]
    p.grad = torch.ones(1)
    opt.step()
    assert p.item() == pytest.approx(-0.15)
    assert opt.param_groups[0]["lr"] == 0.3


def test_clip_gradients_real_grads() -> None:
    m = torch.nn.Linear(4, 3)
    m(torch.randn(8, 4)).pow(2).sum().mul(100).backward()
    total = float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
    coef = clip_gradients(m.parameters(), 0.5, total_norm=total)
    assert coef == pytest.approx(0.5 / total, rel=1e-4)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]))
    assert after == pytest.approx(0.5, rel=1e-4)
    assert clip_gradients(m.parameters(), 10.0) == 1.0  # measured itself, below the norm
    assert clip_gradients(m.parameters(), math.inf) == 1.0


def test_drop_gradients_really_skips_adam() -> None:
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    m(torch.randn(4, 3)).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    drop_gradients(m.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=False))
    assert opt.state_dict()["state"] == {}


def test_checkpoint_roundtrip_atomic(tmp_path) -> None:
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    sched = sched_mod.LambdaLR(opt, lambda s: 0.9**s)
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    path = tmp_path / "ck" / "a.pt"
    save_checkpoint(path, m, opt, sched, step=7, data_position=8, monitor_state={"version": 1},
                    healthy=True, reason="periodic")
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    w = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.add_(1.0)
    opt.step()
    sched.step()
    snap = load_checkpoint(path, m, opt, sched)
    assert torch.equal(m.weight, w)
    assert snap["step"] == 7 and snap["data_position"] == 8 and snap["monitor"] == {"version": 1}
    assert sched.last_epoch == 1


def test_checkpoint_store_memory_and_retention(tmp_path) -> None:
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for directory in (None, tmp_path):
        store = CheckpointStore(directory, keep=2)
        store.save(m, opt, None, step=0, data_position=1, healthy=True)
        store.save(m, opt, None, step=10, data_position=11, healthy=False)
        store.save(m, opt, None, step=20, data_position=21, healthy=False)
        assert sorted(store.entries) == [0, 10, 20] or sorted(store.entries) == [0, 20]
        assert store.latest_healthy().step == 0  # newest healthy one is never pruned
        snap = store.restore(0, m, opt, None)
        assert snap["data_position"] == 1
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(keep=0)


def test_training_stopped_carries_reason() -> None:
    e = TrainingStopped("nonfinite loss", step=3, alarms=("a",))
    assert e.reason == "nonfinite loss" and e.alarms == ("a",) and "step 3" in str(e)
