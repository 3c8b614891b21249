"""The training-health rules practitioners know, on real tiny PyTorch runs (CPU).

SageMaker Debugger's built-in rules are the reference list (``docs/detectors.md`` has the
table). Each test trains the same small ReLU MLP on a fixed teacher through
:class:`~stability.adapters.torch.TorchGuard` with the ``default`` preset (log-only, so the
run is not changed by a response), injects one fault at step :data:`ONSET` by changing what
really happens to the model, optimizer or backward pass, and checks that the rule's binding
fires within a few steps of it -- and that the clean run raises no alarm at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Alarm  # noqa: E402

ONSET, STEPS = 120, 180


class _Spy(Monitor):
    """The default preset, log-only, keeping every alarm it raises."""

    def __init__(self) -> None:
        super().__init__({"preset": "default", "monitor": {"log_only": True}}, alert_sinks=[])
        self.seen: list[Alarm] = []

    def observe(self, step: int, metrics: Any = None, families: Any = None) -> Any:
        d = super().observe(step, metrics, families=families)
        self.seen.extend(d.alarms)
        return d


class _Run:
    """A small ReLU MLP regressing a fixed teacher, with its optimizer (two param groups)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 1))
        self.teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 1))
        body = [p for n, p in self.net.named_parameters() if not n.startswith("4.")]
        head = list(self.net[4].parameters())
        self.opt = torch.optim.AdamW([{"params": body}, {"params": head}], lr=3e-3,
                                     weight_decay=1e-4)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.loss_scale = 1.0
        self.grad_scale = 1.0

    def batch(self) -> tuple[Any, Any]:
        x = torch.randn(64, 16, generator=self.gen)
        with torch.no_grad():
            return x, self.teacher(x)


Fault = Callable[[_Run], None]


def _train(fault: Fault | None = None) -> list[Alarm]:
    run = _Run()
    mon = _Spy()
    guard = TorchGuard(run.net, run.opt, None, mon, activations=["1", "3"], activation_every=1,
                       checkpoint_every=0, update_ratio_every=4, sync="step")
    for step in range(STEPS):
        if fault is not None and step == ONSET:
            fault(run)
        x, y = run.batch()
        loss = torch.nn.functional.mse_loss(run.net(x), y)
        (loss * run.loss_scale).backward()
        if run.grad_scale != 1.0:
            for p in run.net.parameters():
                p.grad.mul_(run.grad_scale)
        guard.step(loss)
    guard.detach()
    return mon.seen


def _fired(alarms: list[Alarm], binding: str, within: int) -> list[Alarm]:
    return [a for a in alarms if a.detector == binding and ONSET <= a.step <= ONSET + within]


@pytest.fixture(scope="module")
def clean() -> list[Alarm]:
    return _train()


def test_a_clean_run_raises_no_alarm(clean: list[Alarm]) -> None:
    assert [(a.step, a.detector, a.signal) for a in clean] == []


def _skip_every_step(run: _Run) -> None:
    run.opt.step = lambda *a, **k: None  # type: ignore[method-assign]


def _freeze_head_group(run: _Run) -> None:
    run.opt.param_groups[1]["lr"] = 0.0


def _vanish(run: _Run) -> None:
    run.loss_scale = 1e-7  # a broken backward: gradients 1e7 times too small


def _explode(run: _Run) -> None:
    run.grad_scale = 1e4


def _kill_relus(run: _Run) -> None:
    with torch.no_grad():
        run.net[2].bias.fill_(-1e3)  # every unit of the second ReLU layer dead


#: Debugger rule -> (fault, the project's binding expected to fire, steps allowed after onset)
RULES: dict[str, tuple[Fault, str, int]] = {
    "updates silently skipped (optimizer)": (_skip_every_step, "no_update", 16),
    "frozen parameter group": (_freeze_head_group, "no_update", 16),
    "VanishingGradient": (_vanish, "grad_vanishing", 2),
    "ExplodingTensor": (_explode, "grad_explosion", 2),
    "DeadRelu": (_kill_relus, "activation_shift", 2),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_rule_fires_on_its_fault(rule: str, clean: list[Alarm]) -> None:
    fault, binding, within = RULES[rule]
    hits = _fired(_train(fault), binding, within)
    assert hits, f"{rule}: {binding} did not fire within {within} steps of the fault"
    assert not [a for a in clean if a.detector == binding]
