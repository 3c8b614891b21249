"""``TrainerGuard``: the guard of the trainer callbacks (state of its ``sync="deferred"`` parts)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.trainer_deferred import TrainerGuard, check_sync  # noqa: E402
from stability.types import Control  # noqa: E402

from .scripted import ScriptedMonitor  # noqa: E402

torch.set_num_threads(1)


def _guard(script: dict[int, Control]) -> tuple[TrainerGuard, torch.nn.Module]:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return TrainerGuard(m, opt, None, ScriptedMonitor(script), checkpoint_every=2, sync="deferred",
                        raise_on_stop=False), m


def _steps(guard: TrainerGuard, m: torch.nn.Module, n: int) -> None:
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        m(torch.randn(4, 3, generator=g)).pow(2).mean().backward()
        guard.check(None)
        if guard.should_step:
            guard.optimizer.step()
        guard.optimizer.zero_grad(set_to_none=True)
        guard.finish()


def test_emergency_is_left_to_the_trainer_and_voided_steps_survive_the_state() -> None:
    guard, m = _guard({3: Control(save_checkpoint=True, checkpoint_reason="x"),
                       5: Control(rollback_to=2)})
    _steps(guard, m, 5)  # step 3 observed during step 4
    assert guard.take_emergency() == (True, "x") and guard.take_emergency() == (False, "")
    assert not any(r.reason.startswith("x") or not r.healthy for r in guard.ledger.records)
    _steps(guard, m, 2)  # step 5's rollback voids step 6
    assert guard.voided_steps == 1 and guard.rollbacks == 1 and guard.step_count == 3
    sd = json.loads(json.dumps(guard.state_dict()))
    assert sd["voided_steps"] == 1
    fresh, _ = _guard({})
    fresh.load_state_dict(sd)
    assert fresh.voided_steps == 1 and fresh.step_count == 3
    sd["voided_steps"] = -1
    with pytest.raises(ValueError, match="voided_steps"):
        fresh.load_state_dict(sd)
    plain, _ = _guard({})
    assert "voided_steps" not in plain.state_dict()  # nothing voided: the step-mode layout


def test_check_sync() -> None:
    assert check_sync("X", "deferred") == "deferred"
    with pytest.raises(ValueError, match="'sync' parameter of X must be one of"):
        check_sync("X", "Step")
