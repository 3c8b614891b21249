"""The trainer-adapter protocol (:mod:`stability.adapters.protocol`): every adapter follows it."""

from __future__ import annotations

import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.protocol import TrainerAdapter, TrainerGuardSeam  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.adapters.trainer_deferred import TrainerGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402

from .scripted import ScriptedMonitor  # noqa: E402

#: (module, callback class, framework it needs)
ADAPTERS = [("stability.adapters.hf", "StabilityTrainerCallback", "transformers"),
            ("stability.adapters.lightning", "StabilityCallback", "lightning")]


def _guard(cls: type) -> TorchGuard:
    m = torch.nn.Linear(3, 1)
    return cls(m, torch.optim.SGD(m.parameters(), lr=0.1), None, ScriptedMonitor({}),
               sync="step", raise_on_stop=False, log_interventions=False)


def test_the_trainer_guard_is_the_seam_and_the_plain_guard_is_not() -> None:
    assert isinstance(_guard(TrainerGuard), TrainerGuardSeam)
    # the plain loop's guard has no trainer-save step: the check can fail
    assert not isinstance(_guard(TorchGuard), TrainerGuardSeam)


def test_the_seam_runs_in_its_order() -> None:
    guard = _guard(TrainerGuard)
    model = guard.model
    for _ in range(3):
        loss = model(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        guard.check(loss)
        guard.optimizer.step()
        guard.optimizer.zero_grad()
        assert guard.finish_step() == (False, "", False)
        assert guard.observe_before_save() == (False, "", False)
    restored = _guard(TrainerGuard)
    restored.load_state_dict(guard.state_dict())
    assert restored.step_count == guard.step_count == 3


@pytest.mark.parametrize(("module", "name", "framework"), ADAPTERS)
def test_every_adapter_follows_the_protocol(module: str, name: str, framework: str) -> None:
    pytest.importorskip(framework)
    cls = getattr(importlib.import_module(module), name)
    cb = cls(Monitor("small"))
    assert isinstance(cb, TrainerAdapter)
    for meth in ("feedback", "state_dict", "load_state_dict"):
        assert len(inspect.signature(getattr(cb, meth)).parameters) == (
            len(inspect.signature(getattr(TrainerAdapter, meth)).parameters) - 1)


@pytest.mark.parametrize(("module", "name", "framework"), ADAPTERS)
def test_adapters_drive_the_guard_through_the_seam(module: str, name: str,
                                                   framework: str) -> None:
    """The callbacks end a step with ``finish_step`` and observe before a save with
    ``observe_before_save`` (the protocol's methods, not private guard internals)."""
    pytest.importorskip(framework)
    src = inspect.getsource(importlib.import_module(module))
    assert ".finish_step()" in src and ".observe_before_save()" in src
    assert "guard._" not in src
