"""TorchGuard wiring of issue 15: the stall watchdog and the rank-outlier alarms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability import EventLog, Monitor, read_events  # noqa: E402
from stability.adapters.distributed import ControlSync  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.run.watchdog import StallWatchdog  # noqa: E402
from stability.types import Alarm, Control  # noqa: E402


def _setup() -> tuple[Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    return model, opt, x, y


def _watchdog_threads() -> int:
    import threading

    return sum(t.name == "stability-watchdog" and t.is_alive() for t in threading.enumerate())


def test_watchdog_beats_and_feeds_step_time(tmp_path: Path) -> None:
    model, opt, x, y = _setup()
    seen: list[dict[str, Any]] = []

    class Spy(Monitor):
        def observe(self, step, metrics=None, families=None):  # type: ignore[no-untyped-def]
            seen.append(dict(metrics or {}))
            return super().observe(step, metrics, families)

    wd = StallWatchdog(min_timeout_s=30.0)
    guard = TorchGuard(model, opt, None, Spy("default"), watchdog=wd)
    for _ in range(6):
        torch.nn.functional.mse_loss(model(x), y).backward()
        guard.step(torch.nn.functional.mse_loss(model(x), y).detach())
    assert guard.watchdog is wd and wd.median_step_s is not None
    assert any("step_time" in m for m in seen[2:])
    assert _watchdog_threads() == 1
    guard.detach()
    assert _watchdog_threads() == 0  # stopped with the guard


class _OneRankFault(ControlSync):
    """A two-rank sync stand-in whose rank 1 is named an outlier at step 3."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 2
        self.rank_alarms: tuple[Alarm, ...] = ()

    def reduce(self, control: Control, step: int, alarmed: bool, **kw: Any
               ) -> tuple[Control, bool]:
        self.rank_alarms = ((Alarm(step, "rank_outlier", "rank1/grad_norm", 41.0, 6.0,
                                   "warning", "rank_mad",
                                   "grad_norm outlier on rank 1 / host-b: 41.0 sigma"),)
                            if step == 3 else ())
        return control, alarmed or bool(self.rank_alarms)


def test_rank_alarms_are_recorded_by_the_monitor(tmp_path: Path) -> None:
    model, opt, x, y = _setup()
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        guard = TorchGuard(model, opt, None, Monitor("default", event_log=log),
                           distributed=_OneRankFault())
        for _ in range(5):
            torch.nn.functional.mse_loss(model(x), y).backward()
            guard.step(torch.nn.functional.mse_loss(model(x), y).detach())
    recs = read_events(path)
    assert [r["step"] for r in recs if r.get("kind") == "rank_outlier"] == [3]
    assert any(r.get("intervention") == "alert" and "rank 1 / host-b" in r["reason"]
               for r in recs)


def test_cadence_advisor_drives_periodic_checkpoints() -> None:
    from stability.run.cadence import CadenceAdvisor

    def run(cadence: CadenceAdvisor | None) -> TorchGuard:
        model, opt, x, y = _setup()
        guard = TorchGuard(model, opt, None, Monitor("default"), checkpoint_every=0,
                           cadence=cadence)
        for _ in range(40):
            torch.nn.functional.mse_loss(model(x), y).backward()
            guard.step(torch.nn.functional.mse_loss(model(x), y).detach())
        return guard

    assert run(None).checkpoints_taken == 0
    # a failure-prone job (50 failures already seen, MTBF ~ milliseconds): frequent saves
    adv = CadenceAdvisor(prior_mtbf_s=0.02)
    for _ in range(50):
        adv.note_failure()
    guard = run(adv)
    assert guard.checkpoints_taken >= 3
    assert adv.saves == guard.checkpoints_taken and adv.save_cost_s > 0
    # a reliable one (MTBF one year): only the first save, to measure its cost
    calm = CadenceAdvisor(prior_mtbf_s=365 * 24 * 3600.0)
    assert run(calm).checkpoints_taken == 1
