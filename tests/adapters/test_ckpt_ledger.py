"""One checkpoint ledger, one goodput ledger: the stores do the file IO, the ledgers keep count.

Real PyTorch on CPU, tiny models.  What is checked:

* the store and the ledger agree (records == restorable checkpoints == files on disk == index)
  after many saves with keep-last pruning, and after a rollback rewound the ledger;
* a rollback never targets a pruned or missing file (deleted behind the store's back, or pruned);
* resume from a state dict + the files on disk reconciles (a missing file is dropped with a
  warning and never targeted; a file saved after the snapshot is adopted);
* the guard's counters are the goodput ledger's numbers, checked against counts taken
  independently of both.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.distributed import ControlSync  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.torch_ops.checkpoint_store import CheckpointStore  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.run.checkpoints import CheckpointLedger  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=3e-3)


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("step-*.pt"))


def _agree(store: CheckpointStore) -> list[int]:
    """Ledger records == restorable entries == files on disk == the on-disk index."""
    steps = [r.step for r in store.ledger.records]
    assert sorted(store.entries) == sorted(steps)
    if store.directory is not None:
        assert _files(store.directory) == sorted(Path(r.path).name for r in store.ledger.records)
        idx = json.loads((store.directory / "index.json").read_text())["entries"]
        assert sorted(r["step"] for r in idx) == sorted(steps)
    return sorted(steps)


# ------------------------------------------------------------------ store <-> ledger
@pytest.mark.parametrize("on_disk", [True, False])
def test_store_and_ledger_agree_after_many_saves_with_pruning(tmp_path: Path,
                                                              on_disk: bool) -> None:
    m, opt = _model()
    led = CheckpointLedger()
    store = CheckpointStore(tmp_path / "ck" if on_disk else None, keep=3, ledger=led)
    assert store.ledger is led and led.files is store and not store.owns_ledger
    for s in range(0, 200, 10):
        healthy = s not in (70, 150, 160)
        store.save(m, opt, None, step=s, data_position=s + 1, healthy=healthy,
                   reason="periodic" if healthy else "emergency")
        steps = _agree(store)
        good = [r.step for r in led.records if r.healthy]
        bad = [r.step for r in led.records if not r.healthy]
        # keep-last: the 3 newest healthy ones and the newest emergency one, nothing else
        assert good == [x for x in range(0, s + 1, 10) if x not in (70, 150, 160)][-3:]
        assert len(bad) <= 1 and steps == sorted(good + bad)
    assert [r.step for r in led.records] == [160, 170, 180, 190]
    # the ledger drops a record when it is told to, and the file goes with it
    led.forget(170)
    assert _agree(store) == [160, 180, 190]
    # a rewind (rollback) drops the abandoned timeline: records and files together
    dropped = led.rewind(180)
    assert [r.step for r in dropped] == [190] and _agree(store) == [160, 180]
    snap = store.restore(180, m, opt, None)
    assert snap["data_position"] == 181
    with pytest.raises(KeyError):
        store.restore(190, m, opt, None)


def test_standalone_store_owns_its_ledger_and_comes_back(tmp_path: Path) -> None:
    m, opt = _model()
    store = CheckpointStore(tmp_path, keep=2)
    assert store.owns_ledger and store.ledger.files is store
    for s in (5, 10, 15):
        store.save(m, opt, None, step=s, data_position=s, healthy=True)
    assert _agree(store) == [10, 15]
    sd = json.loads(json.dumps(store.state_dict()))
    assert [r["step"] for r in sd["ledger"]["records"]] == [10, 15]
    # a new process: from the index on disk alone ...
    again = CheckpointStore(tmp_path, keep=2)
    assert _agree(again) == [10, 15] and again.latest_healthy().step == 15
    # ... or from the state dict, reconciled with the files (15 is gone meanwhile)
    (tmp_path / "step-000000015.pt").unlink()
    fresh = CheckpointStore(None, keep=2)
    fresh.load_state_dict(sd)
    assert [r.step for r in fresh.ledger.records] == [10]
    assert fresh.latest_healthy().step == 10


# ------------------------------------------------------------------ rollback targets
def _train(guard: TorchGuard, model: Any, n: int, *, nan_at: int | None = None,
           done: list[tuple[int, int]] | None = None) -> None:
    xs = torch.randn(n, 16, 4, generator=torch.Generator().manual_seed(1))
    injected = False
    for i in guard.batches(n):
        if nan_at is not None and guard.step_count == nan_at and not injected:
            injected = True  # a one-off corruption of the weights
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = math.nan
        x = xs[i]
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        guard.step(loss)


def _spy_restores(guard: TorchGuard) -> list[tuple[int, bool, bool]]:
    """Every restore: (step, its file existed, the step was still in the ledger)."""
    seen: list[tuple[int, bool, bool]] = []
    real = guard.store.restore

    def restore(step: int, *a: Any) -> Any:
        rec = next((r for r in guard.ledger.records if r.step == step), None)
        seen.append((step, rec is not None and Path(rec.path).is_file(), rec is not None))
        return real(step, *a)

    guard.store.restore = restore  # type: ignore[method-assign]
    return seen


def test_rollback_never_targets_a_pruned_checkpoint(tmp_path: Path) -> None:
    model, opt = _model()
    mon = Monitor("small", alert_sinks=[])
    guard = TorchGuard(model, opt, None, mon, checkpoint_dir=tmp_path, checkpoint_every=5,
                       keep_checkpoints=2, log_interventions=False)
    seen = _spy_restores(guard)
    _train(guard, model, 90, nan_at=61)
    rb = [i for i in guard.interventions if i.type == "rollback"]
    assert rb and guard.rollbacks == len(seen) >= 1
    assert all(exists and listed for _, exists, listed in seen)
    assert [s for s, _, _ in seen] == [i.to_step for i in rb]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _agree(guard.store)  # pruning and the rewind left records and files in step


def test_a_file_deleted_behind_the_stores_back_is_never_targeted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _model()
    mon = Monitor("small", alert_sinks=[])
    guard = TorchGuard(model, opt, None, mon, checkpoint_dir=tmp_path, checkpoint_every=10,
                       keep_checkpoints=3, log_interventions=False)
    seen = _spy_restores(guard)
    _train(guard, model, 55)
    assert [r.step for r in mon.checkpoints.records] == [30, 40, 50]
    (tmp_path / "step-000000050.pt").unlink()   # a user / a disk cleaner removed it
    with caplog.at_level(logging.WARNING):
        _train(guard, model, 58, nan_at=56)
    assert [s for s, _, _ in seen] == [40]       # the policy targeted the older one
    assert all(exists for _, exists, _ in seen)
    assert any("step 50" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
    # training went on from 40 and took step 50's checkpoint again (the emergency one of step
    # 56 is kept for forensics: unhealthy, never a target)
    assert [(r.step, r.healthy) for r in mon.checkpoints.records] == [
        (30, True), (40, True), (50, True), (56, False)]
    _agree(guard.store)
    # a direct rollback to a missing step falls back to the newest existing one before it
    (tmp_path / "step-000000050.pt").unlink()
    assert guard.rollback(50) and seen[-1] == (40, True, True)
    assert 50 not in [r.step for r in mon.checkpoints.records]


def test_a_corrupt_checkpoint_is_dropped_and_the_next_one_restored(tmp_path: Path) -> None:
    model, opt = _model()
    guard = TorchGuard(model, opt, None, None, checkpoint_dir=tmp_path, checkpoint_every=10,
                       log_interventions=False)
    _train(guard, model, 35)
    assert [r.step for r in guard.ledger.records] == [0, 10, 20, 30]
    (tmp_path / "step-000000030.pt").write_bytes(b"not a checkpoint")
    assert guard.rollback(30)
    assert guard.step_count == 21 and [r.step for r in guard.ledger.records] == [0, 10, 20]
    assert guard.rollbacks == 1 and guard.steps_lost == 35 - 20


# ------------------------------------------------------------------ resume
def _guard(d: Path, state: Any = None, weights: Any = None) -> tuple[TorchGuard, Any]:
    model, opt = _model()
    if weights is not None:
        model.load_state_dict(weights[0])
        opt.load_state_dict(weights[1])
    guard = TorchGuard(model, opt, None, Monitor("small", alert_sinks=[]), checkpoint_dir=d,
                       checkpoint_every=10, keep_checkpoints=3, log_interventions=False)
    if state is not None:
        guard.load_state_dict(state)
    return guard, model


def test_resume_reconciles_the_ledger_with_the_files_on_disk(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, model = _guard(tmp_path)
    _train(first, model, 45)
    state = json.loads(json.dumps(first.state_dict()))
    weights = (copy.deepcopy(model.state_dict()), copy.deepcopy(first.optimizer.state_dict()))
    assert [r["step"] for r in state["monitor"]["checkpoints"]["records"]] == [20, 30, 40]
    _train(first, model, 52)                      # one more checkpoint after the snapshot: 50
    assert _agree(first.store) == [30, 40, 50]
    (tmp_path / "step-000000040.pt").unlink()     # lost in the crash
    with caplog.at_level(logging.WARNING):
        second, model2 = _guard(tmp_path, state, weights)
    # 20 was pruned (file gone), 40 is missing: both dropped with a warning; 50 adopted
    assert [r.step for r in second.ledger.records] == [30, 50]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "step 20" in warned and "step 40" in warned
    _agree(second.store)
    seen = _spy_restores(second)
    _train(second, model2, 60, nan_at=56)
    assert seen and all(exists and listed for _, exists, listed in seen)
    assert seen[0][0] in (30, 50) and second.rollbacks == 1


# ------------------------------------------------------------------ one goodput ledger
class _Counting:
    """A guard wrapper that counts what happened independently of every ledger."""

    def __init__(self, guard: TorchGuard) -> None:
        self.rollbacks: list[tuple[int, int]] = []
        self.skipped = 0
        real_rb = guard.rollback

        def rollback(to_step: int, skip: Any = None) -> bool:
            at = guard.step_count
            ok = real_rb(to_step, skip)
            if ok:
                self.rollbacks.append((at, guard.step_count - 1))
            return ok

        guard.rollback = rollback  # type: ignore[method-assign]
        real_check = guard.check

        def check(*a: Any, **k: Any) -> Decision:
            d = real_check(*a, **k)
            c = guard.control
            self.skipped += bool(c.skip_step and c.rollback_to is None and not c.stop)
            return d

        guard.check = check  # type: ignore[method-assign]
        self.saves = 0
        real_save = guard.store.save

        def save(*a: Any, **k: Any) -> Any:
            out = real_save(*a, **k)
            self.saves += 1
            return out

        guard.store.save = save  # type: ignore[method-assign]


def test_guard_counters_are_the_goodput_ledger(tmp_path: Path) -> None:
    model, opt = _model()
    mon = Monitor("small", alert_sinks=[])
    guard = TorchGuard(model, opt, None, mon, checkpoint_every=5, log_interventions=False)
    assert guard.goodput is mon.goodput
    count = _Counting(guard)
    used: list[int] = []
    xs = torch.randn(120, 16, 4, generator=torch.Generator().manual_seed(2))
    for i in guard.batches(120):
        used.append(i)
        x = xs[i] * (1e3 if i in (40, 41, 42, 80) else 1.0)   # bad batches
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        guard.step(loss)
    g = mon.goodput
    assert count.rollbacks or count.skipped  # the faults were acted on
    lost = sum(a - b for a, b in count.rollbacks)
    batches_skipped = sum(1 for i in range(max(used) + 1) if i not in used)
    assert (guard.rollbacks, guard.steps_lost) == (g.rollbacks, g.lost) == (
        len(count.rollbacks), lost)
    assert guard.steps_skipped == g.skipped == count.skipped
    assert guard.batches_skipped == g.batches_skipped == batches_skipped
    assert guard.checkpoints_taken == g.checkpoints == count.saves > 0
    assert g.steps == len(used) and g.productive == g.steps - g.skipped - g.lost
    m = guard.metrics()
    assert m["stability/rollbacks"] == g.rollbacks and m["stability/steps_lost"] == g.lost
    # the counts travel with the monitor's state (the guard keeps no copy)
    sd = json.loads(json.dumps(guard.state_dict()))
    assert set(sd["counters"]) == {"amp_overflows"} and sd["goodput"] is None
    m2, opt2 = _model()
    g2 = TorchGuard(m2, opt2, None, Monitor("small", alert_sinks=[]), checkpoint_every=5)
    g2.load_state_dict(sd)
    assert (g2.steps_skipped, g2.rollbacks, g2.steps_lost, g2.batches_skipped) == (
        guard.steps_skipped, guard.rollbacks, guard.steps_lost, guard.batches_skipped)


def test_guard_without_a_monitor_keeps_its_own_goodput_ledger() -> None:
    class _Scripted:
        def observe(self, step: int, metrics: Any = None, families: Any = None) -> Decision:
            return Decision(step, control=Control(skip_step=step in (2, 3)))

    model, opt = _model()
    guard = TorchGuard(model, opt, None, _Scripted(), checkpoint_every=0)
    _train(guard, model, 6)
    assert guard.goodput.steps == 6 and guard.steps_skipped == guard.goodput.skipped == 2
    sd = json.loads(json.dumps(guard.state_dict()))
    assert sd["goodput"]["skipped"] == 2
    m2, opt2 = _model()
    again = TorchGuard(m2, opt2, None, _Scripted(), checkpoint_every=0)
    again.load_state_dict(sd)
    assert again.steps_skipped == 2 and again.goodput.steps == 6
    # a version-1 snapshot kept the counts in the guard: they reach the ledger
    old = dict(sd, goodput=None, counters={"steps_skipped": 4, "rollbacks": 1, "steps_lost": 3})
    again.load_state_dict(old)
    assert (again.steps_skipped, again.rollbacks, again.steps_lost) == (4, 1, 3)


class _OtherRankSkips(ControlSync):
    """Another rank asks to skip steps 3 and 4; this rank's monitor saw nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size = 2

    def reduce(self, control: Control, step: int, alarmed: bool, **kw: Any
               ) -> tuple[Control, bool]:
        if step in (3, 4):
            return dataclasses.replace(control, skip_step=True), True
        return control, alarmed


def test_a_skip_asked_by_another_rank_is_counted_in_the_monitors_ledger() -> None:
    model, opt = _model()
    mon = Monitor("small", alert_sinks=[])
    guard = TorchGuard(model, opt, None, mon, checkpoint_every=0, distributed=_OtherRankSkips(),
                       log_interventions=False)
    assert guard.sync is not None
    _train(guard, model, 8)
    assert mon.goodput.skipped == guard.steps_skipped == 2 and mon.goodput.steps == 8
    assert mon.goodput.productive == 6
