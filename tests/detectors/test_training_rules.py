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


#: the opt-in "loss not decreasing" binding (docs/detectors.md), added to the default preset
NO_PROGRESS = {"name": "loss_not_decreasing", "detector": "no_progress", "inputs": ["loss"],
               "kind": "stall"}


class _Spy(Monitor):
    """The default preset, log-only, keeping every alarm it raises."""

    def __init__(self, extra: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__({"preset": "default", "monitor": {"log_only": True},
                          "detectors": list(extra)}, alert_sinks=[])
        self.seen: list[Alarm] = []

    def observe(self, step: int, metrics: Any = None, families: Any = None) -> Any:
        d = super().observe(step, metrics, families=families)
        self.seen.extend(d.alarms)
        return d


class _Run:
    """A small ReLU MLP regressing a fixed teacher, with its optimizer (two param groups)."""

    def __init__(self, seed: int = 0, act: str = "relu") -> None:
        torch.manual_seed(seed)
        nonlin = torch.nn.ReLU if act == "relu" else torch.nn.Tanh
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), nonlin(), torch.nn.Linear(64, 64), nonlin(),
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


def _train(fault: Fault | None = None, act: str = "relu", steps: int = STEPS,
           onset: int = ONSET, extra: tuple[dict[str, Any], ...] = ()) -> list[Alarm]:
    run = _Run(act=act)
    mon = _Spy(extra)
    guard = TorchGuard(run.net, run.opt, None, mon, activations=["1", "3"], activation_every=1,
                       checkpoint_every=0, update_ratio_every=4, sync="step")
    for step in range(steps):
        if fault is not None and step == onset:
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


def _fired(alarms: list[Alarm], binding: str, within: int, onset: int = ONSET) -> list[Alarm]:
    return [a for a in alarms if a.detector == binding and onset <= a.step <= onset + within]


@pytest.fixture(scope="module")
def clean() -> list[Alarm]:
    return _train()


@pytest.fixture(scope="module")
def clean_tanh() -> list[Alarm]:
    return _train(act="tanh")


def test_a_clean_run_raises_no_alarm(clean: list[Alarm], clean_tanh: list[Alarm]) -> None:
    assert [(a.step, a.detector, a.signal) for a in clean] == []
    assert [(a.step, a.detector, a.signal) for a in clean_tanh] == []


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


def _lr_spike(run: _Run) -> None:
    for g in run.opt.param_groups:
        g["lr"] *= 300.0  # a schedule bug: every update 300 times too large


def _saturate(run: _Run) -> None:
    with torch.no_grad():
        run.net[0].weight.mul_(200.0)  # pre-activations far into the flat part of tanh


#: Debugger rule -> (fault, activation, the project's binding expected to fire, steps allowed)
RULES: dict[str, tuple[Fault, str, str, int]] = {
    "UnchangedTensor (optimizer silently skips)": (_skip_every_step, "relu", "no_update", 16),
    "UnchangedTensor (frozen parameter group)": (_freeze_head_group, "relu", "no_update", 16),
    "VanishingGradient": (_vanish, "relu", "grad_vanishing", 2),
    "ExplodingTensor": (_explode, "relu", "grad_explosion", 2),
    "DeadRelu": (_kill_relus, "relu", "activation_shift", 2),
    "SaturatedActivation": (_saturate, "tanh", "activation_shift", 2),
}


def test_update_ratio_out_of_range() -> None:
    """WeightUpdateRatio (too large): ``update_ratio_layers``.  The ratio is logged every 4
    steps, so its 40-value warm-up lasts 160 steps: the fault comes at step 200."""
    hits = _fired(_train(_lr_spike, steps=220, onset=200), "update_ratio_layers", 8, 200)
    assert hits and hits[0].step == 201  # measured on step 200's update, reported with 201
    assert not [a for a in _train(steps=220) if a.detector == "update_ratio_layers"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_rule_fires_on_its_fault(rule: str, clean: list[Alarm],
                                     clean_tanh: list[Alarm]) -> None:
    fault, act, binding, within = RULES[rule]
    hits = _fired(_train(fault, act), binding, within)
    assert hits, f"{rule}: {binding} did not fire within {within} steps of the fault"
    assert not [a for a in (clean if act == "relu" else clean_tanh) if a.detector == binding]


def _zero_lr(run: _Run) -> None:
    for g in run.opt.param_groups:
        g["lr"] = 0.0  # LossNotDecreasing / PoorWeightInitialization: the run never learns


def test_loss_not_decreasing_is_the_opt_in_binding() -> None:
    steps = 360
    stuck = _train(_zero_lr, steps=steps, onset=0, extra=(NO_PROGRESS,))
    learning = _train(steps=steps, extra=(NO_PROGRESS,))
    assert [a.step for a in stuck if a.detector == "loss_not_decreasing"][:1] == [300]
    assert [a for a in learning if a.detector == "loss_not_decreasing"] == []
