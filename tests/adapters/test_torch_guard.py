"""The plain-PyTorch guard with the real Monitor on tiny runs, and the tinytrain faults."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard, find_ledger  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.testing.tinytrain import FaultSpec, flip_bit, train_run  # noqa: E402
from stability.types import Control, Decision  # noqa: E402


def test_import_stability_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, stability, stability.adapters; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_clean_run_no_interventions_and_fault_rescued() -> None:
    clean = train_run("mlp", 140, seed=0)
    watched = train_run("mlp", 140, seed=0, monitor=Monitor("small"))
    assert watched.acting_interventions() == []
    assert watched.final_loss == pytest.approx(clean.final_loss, rel=1e-6)
    fault = FaultSpec("bit_flip", 100)
    broken = train_run("mlp", 140, seed=0, fault=fault)
    saved = train_run("mlp", 140, seed=0, fault=fault, monitor=Monitor("small"))
    assert not math.isfinite(broken.final_loss)
    assert saved.rollbacks >= 1 and saved.steps_lost > 0
    assert abs(saved.final_loss / clean.final_loss - 1) < 0.05


class _Scripted:
    """Stand-in monitor that issues scripted controls (exercises every action)."""

    def __init__(self, script: dict[int, Control]) -> None:
        self.script = script
        self.seen: list[int] = []
        from stability.run.checkpoints import CheckpointLedger

        self.checkpoints = CheckpointLedger()

    def observe(self, step: int, metrics=None, families=None) -> Decision:
        self.seen.append(step)
        return Decision(step, control=self.script.pop(step, Control()))

    def state_dict(self) -> dict:
        return {"version": 1, "seen": list(self.seen)}


def _loop(script: dict[int, Control], n: int = 12, **kw):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mon = _Scripted(script)
    guard = TorchGuard(m, opt, sched, mon, **{"checkpoint_every": 2, **kw})
    used = []
    for i in guard.batches(n):
        used.append(i)
        g = torch.Generator().manual_seed(i)
        loss = m(torch.randn(4, 3, generator=g)).pow(2).mean()
        loss.backward()
        guard.step(loss)
    return guard, mon, used, m


def test_skip_rollback_and_batch_skipping() -> None:
    script = {3: Control(skip_step=True),
              7: Control(save_checkpoint=True, rollback_to=4, skip_batches=(5, 7))}
    guard, mon, used, _ = _loop(script)
    # step 3 is skipped; the rollback's own step 7 is lost (5, 6, 7), not also skipped
    assert guard.steps_skipped == 1 and guard.rollbacks == 1
    assert mon.seen[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 5]  # steps restart after the checkpoint
    assert used[:8] == list(range(8)) and used[8] == 8  # batches 5..7 are skipped
    assert guard.batches_skipped == 3 and guard.steps_lost == 3
    g = guard.goodput  # the scripted monitor has no goodput ledger: the guard keeps one
    assert (g.skipped, g.rollbacks, g.lost, g.batches_skipped) == (1, 1, 3, 3)
    assert g.steps == len(mon.seen) and g.productive == len(mon.seen) - 4
    recs = find_ledger(mon).records
    # one registry: the store restores exactly what the ledger lists
    assert guard.store.ledger is find_ledger(mon)
    assert sorted(guard.store.entries) == [r.step for r in recs]
    healthy = sorted(s for s, e in guard.store.entries.items() if e.healthy)
    assert [r.step for r in recs if r.healthy] == healthy and len(healthy) == 4


def test_stop_raises_typed_exception() -> None:
    from stability.adapters.interventions import TrainingStopped

    with pytest.raises(TrainingStopped, match="enough"):
        _loop({5: Control(stop=True, stop_reason="enough")})


def test_clip_and_lr_factor_applied() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mon = _Scripted({0: Control(clip_norm=0.01, lr_factor=0.5), 1: Control(lr_factor=0.5)})
    guard = TorchGuard(m, opt, sched, mon, checkpoint_every=0, update_ratio_every=0)
    w0 = m.weight.detach().clone()
    loss = m(torch.ones(1, 2)).sum() * 100
    loss.backward()
    guard.step(loss)
    delta = (m.weight.detach() - w0).norm().item()
    assert delta == pytest.approx(0.5 * 0.01, rel=1e-3)  # clipped to 0.01, LR halved
    # between steps the groups show the LR really applied; the scheduler's value is kept aside
    assert opt.param_groups[0]["lr"] == 0.5
    assert guard.multiplier.base_lrs() == [1.0]
    assert sched.get_last_lr() == [1.0]


def test_guard_state_dict_roundtrip() -> None:
    guard, _, _, _ = _loop({}, n=5)
    sd = guard.state_dict()
    g2, _, _, _ = _loop({}, n=1)
    g2.monitor = None
    g2.load_state_dict(sd)
    assert g2.step_count == guard.step_count and g2.data_position == guard.data_position


def test_flip_bit_and_fault_spec() -> None:
    t = torch.tensor([1.0, 0.25])
    assert flip_bit(t, 1, 30) > 1e30
    assert flip_bit(t, 1, 30) == 0.25  # flipping twice restores
    with pytest.raises(ValueError, match="kind"):
        FaultSpec("meteor", 3)
    assert FaultSpec("overfit", 3).active(10**6)


_CLAIM = "stop with the weights of step 6 restored (cause: lr)"


def test_a_stop_whose_restore_fails_says_the_weights_were_kept() -> None:
    """No checkpoint to restore: ``restored_step`` is None and the message says so (it used
    to repeat the policy's "weights of step 6 restored")."""
    from stability.adapters.interventions import TrainingStopped

    stop = Control(stop=True, stop_reason=f"step 9: loss up -> {_CLAIM}", rollback_to=6)
    with pytest.raises(TrainingStopped) as e:
        _loop({9: stop}, checkpoint_every=0)
    assert e.value.restored_step is None
    assert "weights of step 6 restored" not in str(e.value)
    assert "the weights of step 9 kept" in e.value.reason
    assert "the checkpoint of step 6 could not be restored" in e.value.reason


def test_a_stop_restoring_an_older_checkpoint_names_it(tmp_path) -> None:
    """The checkpoint the policy named is unreadable: the guard restores the next older one
    (step 4) and the message names that one."""
    from stability.adapters.interventions import TrainingStopped

    class _Stop(_Scripted):
        def observe(self, step: int, metrics=None, families=None) -> Decision:
            if step == 9:  # the checkpoint of step 6 went bad on disk
                (tmp_path / "step-000000006.pt").write_bytes(b"not a checkpoint")
            return super().observe(step, metrics, families)

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    stop = Control(stop=True, stop_reason=f"step 9: loss up -> {_CLAIM}", rollback_to=6)
    guard = TorchGuard(m, opt, None, _Stop({9: stop}), checkpoint_every=2,
                       checkpoint_dir=tmp_path)
    with pytest.raises(TrainingStopped) as e:
        for i in guard.batches(12):
            loss = m(torch.randn(4, 3, generator=torch.Generator().manual_seed(i))).pow(2).mean()
            loss.backward()
            guard.step(loss)
    assert e.value.restored_step == 4
    assert "the weights of step 4 restored (the checkpoint of step 6 could not be restored)" \
        in e.value.reason
