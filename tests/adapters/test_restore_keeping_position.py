"""A deterministic fault in the model state: restore the healthy weights without replaying its step.

A weight corruption that happens again whenever its step is replayed (a bit flip tied to the
step, as the shared rescue harness injects it) defeats a rollback: the replay brings it back.
Invariant 6 (an action that did not help is not repeated): when the fault recurs at the same step
after a rollback, the guard restores the healthy weights and optimizer state *keeping* the
position -- step counter, scheduler and data go on -- so the faulty step is never replayed.

Real PyTorch on CPU with a real scheduler; plain torch (both ``sync`` modes), HF ``Trainer`` and
Lightning.  Before this mechanism every one of these runs was stopped.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability import Monitor  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.policy.policy import Policy  # noqa: E402
from stability.run.checkpoints import CheckpointLedger  # noqa: E402
from stability.testing.tasks import warmup_cosine  # noqa: E402
from stability.types import Alarm, Control  # noqa: E402
from tests.adapters.test_rescue_mechanisms import make_problem  # noqa: E402

torch.set_num_threads(1)
STEPS = 300
AT = 150          # the guard step whose replay brings the corruption back
HUGE = 3.0e37     # what an exponent bit flip makes of a small weight


def _bench(name: str) -> Any:
    """``benchmarks/<name>.py`` (the field scenarios' trainers), imported once."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _flip(last: torch.nn.Linear) -> None:
    with torch.no_grad():
        last.weight.view(-1)[3] = HUGE


def _torch_run(sync: str = "step", fault: bool = True):
    model, xs, ys = make_problem()  # the rescue-mechanism tests' problem (same STEPS)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(STEPS, 20))
    guard = TorchGuard(model, opt, sched, Monitor("small"), checkpoint_every=25, sync=sync)
    flips = 0
    for i in guard.batches(STEPS):
        if fault and guard.step_count == AT:   # a property of the step: a replay repeats it
            flips += 1
            _flip(model[2])
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        loss.backward()
        guard.step(loss)
    guard.detach()
    with torch.no_grad():
        held_out = float(torch.nn.functional.mse_loss(model(xs[STEPS:]), ys[STEPS:]))
    return guard, model, flips, held_out


def _kept(guard: Any) -> list[Any]:
    return [i for i in guard.interventions if i.type == "rollback" and i.keep_position]


@pytest.mark.parametrize("sync", ["step", "deferred"])
def test_a_fault_that_recurs_on_replay_is_restored_without_replaying_its_step(sync: str) -> None:
    _, _, _, clean = _torch_run(sync, fault=False)
    guard, model, flips, held_out = _torch_run(sync)
    assert guard.stopped is None                       # before: stopped, rollback limit used up
    assert flips == 2                                  # the fault, then its replay -- no third
    kept = _kept(guard)
    assert len(kept) == 1 and kept[0].to_step < AT <= kept[0].step
    assert kept[0].cause == "corruption"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert held_out <= 1.05 * clean
    # the position was kept: every batch was trained on, the step counter never went back
    assert guard.data_position == STEPS
    # steps lost are counted honestly: the restore threw away the steps since its checkpoint
    lost_here = kept[0].step - kept[0].to_step
    assert guard.steps_lost_in_place == lost_here
    assert guard.steps_lost >= lost_here + 1           # + the first (replaying) rollback's


def test_restore_keeping_position_survives_a_state_round_trip() -> None:
    guard, *_ = _torch_run("step")
    sd = guard.state_dict()
    pol = guard.monitor.policy
    assert pol.state_dict()["kept_onsets"]
    twin = Policy(pol.config)
    twin.load_state_dict(pol.state_dict())
    assert twin.state_dict() == pol.state_dict()
    assert guard.steps_lost_in_place > 0  # a view of the goodput ledger, in the monitor's state
    model2 = torch.nn.Linear(2, 1)
    g2 = TorchGuard(model2, torch.optim.SGD(model2.parameters(), 0.1), None, Monitor("small"),
                    checkpoint_every=25)
    g2.load_state_dict(sd)
    assert (g2.steps_lost_in_place, g2.steps_lost) == (guard.steps_lost_in_place,
                                                       guard.steps_lost)


def _alarm(step: int) -> list[Alarm]:
    return [Alarm(step, "nonfinite", "param_norm", math.inf, 0.0, "critical", "nonfinite")]


def _ledger(*healthy: int) -> CheckpointLedger:
    led = CheckpointLedger()
    for s in healthy:
        led.add(s, f"ckpt-{s}")
    return led


def test_policy_restores_once_per_onset_then_trains_through() -> None:
    """The policy's side: rollback, then (the fault replayed at its onset) a restore keeping the
    position; the same onset again is not answered the same way (invariant 6), and a snapshot
    taken in between makes the same decisions."""
    pol = Policy({"max_rollbacks": 3})
    led = _ledger(100)

    def step(p: Policy, s: int) -> tuple[list[str], Control]:
        ctl = Control()
        ivs = p.step(s, _alarm(s), ctl, {"healthy_checkpoints": led})
        return [i.type for i in ivs], ctl

    types, ctl = step(pol, 150)
    assert "rollback" in types and not ctl.keep_position and ctl.rollback_to == 100
    types, ctl = step(pol, 150)              # replayed: the fault is deterministic
    assert "rollback" in types and ctl.keep_position and ctl.rollback_to == 100
    assert ctl.skip_batches is None
    twin = Policy({"max_rollbacks": 3})
    twin.load_state_dict(pol.state_dict())
    a, b = step(pol, 150), step(twin, 150)  # the same onset a third time
    assert a[0] == b[0] and a[1] == b[1]
    assert not a[1].keep_position            # not repeated


def test_control_keep_position_round_trips() -> None:
    c = Control(rollback_to=7, keep_position=True)
    assert Control.from_dict(c.to_dict()) == c
    assert "keep_position" not in Control().to_dict()   # records without it are as before
    c.reset_step()
    assert not c.keep_position


# ---------------------------------------------------------------------------- trainers
def test_hf_trainer_restores_without_replaying_the_faulty_step(tmp_path) -> None:
    pytest.importorskip("transformers")
    import transformers

    field_hf = _bench("field_hf")

    clean = field_hf.run("fp32", "clean", False).final_loss
    ph = field_hf._trainer(str(tmp_path), "fp32", "clean", 0, None)
    cb, net = ph.callback, ph.model.net

    class Flip(transformers.TrainerCallback):  # type: ignore[misc]
        flips = 0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cb.guard is not None and cb.guard.step_count == field_hf.FAULT_AT:
                Flip.flips += 1
                _flip(net[-1])

    ph.trainer.add_callback(Flip())
    ph.trainer.train()
    g = cb.guard
    assert cb.stopped is None and Flip.flips == 2
    assert len(_kept(g)) == 1
    assert field_hf.held_out_loss(net, 0) <= 1.05 * clean
    assert ph.trainer.state.global_step == g.step_count + g.steps_lost - g.steps_lost_in_place


def test_lightning_restores_without_replaying_the_faulty_step(tmp_path) -> None:
    pytest.importorskip("lightning")
    import lightning as L

    field_pl = _bench("field_lightning")

    clean = field_pl.run("fp32", "clean", False).final_loss
    ph = field_pl._trainer(str(tmp_path), "fp32", "clean", 0, field_pl.STEPS)
    cb, net = ph.callback, ph.module.net

    class Flip(L.Callback):
        flips = 0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            if cb.guard is not None and cb.guard.step_count == field_pl.FAULT_AT:
                Flip.flips += 1
                _flip(net[-1])

    ph.trainer.callbacks.insert(0, Flip())
    ph.trainer.fit(ph.module, field_pl.loader(0))
    g = cb.guard
    assert cb.stopped is None and Flip.flips == 2
    assert len(_kept(g)) == 1
    assert field_pl.held_out_loss(net, 0) <= 1.05 * clean
    assert ph.trainer.global_step == g.step_count + g.steps_lost - g.steps_lost_in_place
