"""The torch guard feeds the monitor's goodput ledger: clock, checkpoint saves, the rollback it
really did (counted once), a refused rollback withdrawn."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.run.checkpoints import CheckpointLedger  # noqa: E402
from stability.run.goodput import GoodputTracker  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)


class _Scripted:
    """Issues scripted controls and feeds its ledger the way :class:`Monitor` does."""

    def __init__(self, script: dict[int, Control]) -> None:
        self.script = script
        self.checkpoints = CheckpointLedger()
        self.goodput = GoodputTracker(auto_start=False)
        self.refused: list[int] = []

    def observe(self, step: int, metrics=None, families=None) -> Decision:  # type: ignore[no-untyped-def]
        c = self.script.pop(step, Control())
        self.goodput.update_from_control(step, c)
        return Decision(step, control=c)

    def rollback_failed(self, step: int, reason: str = "") -> None:
        self.refused.append(step)
        self.goodput.cancel_rollback(step)


def _run(script: dict[int, Control], n: int = 10, **kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = _Scripted(script)
    guard = TorchGuard(m, opt, None, mon, log_interventions=False, **kw)
    for i in guard.batches(n):
        g = torch.Generator().manual_seed(i)
        loss = m(torch.randn(4, 3, generator=g)).pow(2).mean()
        loss.backward()
        guard.step(loss)
    return guard, mon.goodput, mon


def test_rollback_to_an_older_checkpoint_is_counted_once_as_done() -> None:
    # no checkpoint at step 5: the guard restores step 4, so 3 steps are lost, not 2
    guard, led, _ = _run({7: Control(rollback_to=5)}, checkpoint_every=2)
    assert guard.rollbacks == 1 and guard.steps_lost == 3
    assert led.rollbacks == 1 and led.lost == 3
    assert led.checkpoints == guard.checkpoints_taken > 0
    assert led.timing and led.time_checkpoint >= 0.0 and led.wall_time > 0.0


def test_refused_rollback_is_withdrawn_from_the_ledger() -> None:
    guard, led, mon = _run({6: Control(rollback_to=2)}, checkpoint_every=0)
    assert mon.refused == [6] and guard.rollbacks == 0
    assert led.rollbacks == 0 and led.lost == 0 and led.steps == 10


def test_real_monitor_ledger_is_started_and_counts_every_step() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = Monitor("small", alert_sinks=[])
    assert not mon.goodput.timing
    guard = TorchGuard(m, opt, None, mon, checkpoint_every=3, log_interventions=False)
    assert mon.goodput.timing
    for _ in range(7):
        loss = m(torch.randn(4, 3)).pow(2).mean()
        loss.backward()
        guard.step(loss)
    assert mon.goodput.steps == 7 and mon.goodput.checkpoints == guard.checkpoints_taken == 3
    assert mon.state_dict()["goodput"]["steps"] == 7
