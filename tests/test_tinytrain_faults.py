"""The tinytrain fault kinds do what they say: real torch on CPU, short MLP runs."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.testing.tinytrain import (  # noqa: E402
    _FAULT_DEFAULTS,
    FAULT_CLOCK,
    FAULT_KINDS,
    FaultInjector,
    FaultSpec,
    make_task,
    prose_text,
    spike_module,
    train_run,
)
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)

STEPS = 60
ONSET = 30


class ScriptedRollback:
    """A stand-in monitor that asks for one rollback to ``to_step`` at step ``at``."""

    def __init__(self, at: int, to_step: int) -> None:
        self.at, self.to_step, self.done = at, to_step, False

    def observe(self, step: int, metrics: Any, **kw: Any) -> Decision:
        if step == self.at and not self.done:
            self.done = True
            return Decision(step, control=Control(rollback_to=self.to_step))
        return Decision(step, control=Control())


class Recorder:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log(self, step: int, metrics: Any) -> None:
        self.rows[step] = dict(metrics)


@pytest.fixture(scope="module")
def clean() -> Any:
    return train_run("mlp", STEPS, seed=3, eval_every=0)


def _ratios(res: Any, ref: Any) -> list[float]:
    return [a / b for a, b in zip(res.lrs, ref.lrs, strict=True)]


def test_kinds_are_complete_and_validated() -> None:
    assert set(FAULT_KINDS) == set(_FAULT_DEFAULTS) == set(FAULT_CLOCK)
    assert set(FAULT_CLOCK.values()) == {"iteration", "scheduler", "data"}
    with pytest.raises(ValueError, match="kind"):
        FaultSpec("cosmic_ray", 3)
    assert FaultSpec("schedule_bug", 5, duration=0).duration == 0
    assert FaultSpec("fp16_overflow", 5).magnitude == math.inf


def test_clean_lrs_follow_the_schedule(clean: Any) -> None:
    assert len(clean.lrs) == STEPS
    assert all(math.isfinite(v) and v > 0 for v in clean.lrs)
    assert clean.lrs[-1] < clean.lrs[STEPS // 2] < max(clean.lrs)


def test_lr_persistent_holds_to_the_end(clean: Any) -> None:
    res = train_run("mlp", STEPS, seed=3, eval_every=0, fault=FaultSpec("lr_persistent", ONSET))
    r = _ratios(res, clean)
    assert r[:ONSET] == pytest.approx([1.0] * ONSET)
    assert r[ONSET:] == pytest.approx([30.0] * (STEPS - ONSET))
    assert res.losses[:ONSET] == clean.losses[:ONSET]


def test_lr_ramp_rises_linearly_then_holds(clean: Any) -> None:
    f = FaultSpec("lr_ramp", ONSET, duration=10, magnitude=20.0)
    r = _ratios(train_run("mlp", STEPS, seed=3, eval_every=0, fault=f), clean)
    expect = [1.0 + 19.0 * min(1.0, (s - ONSET + 1) / 10) if s >= ONSET else 1.0
              for s in range(STEPS)]
    assert r == pytest.approx(expect)
    assert r[ONSET] < r[ONSET + 4] < r[ONSET + 9] == pytest.approx(20.0)


@pytest.mark.parametrize("duration", [0, 10])
def test_schedule_bug_permanent_and_windowed(clean: Any, duration: int) -> None:
    f = FaultSpec("schedule_bug", ONSET, duration=duration, magnitude=30.0)
    r = _ratios(train_run("mlp", STEPS, seed=3, eval_every=0, fault=f), clean)
    end = STEPS if duration == 0 else ONSET + duration
    expect = [30.0 if ONSET <= s < end else 1.0 for s in range(STEPS)]
    assert r == pytest.approx(expect)


def _lrs_after_rollback(kind: str, **kw: Any) -> tuple[list[float], Any]:
    """An lr fault at ONSET, a scripted rollback at step 40 to the checkpoint of step 20."""
    res = train_run("mlp", STEPS, seed=3, eval_every=0, fault=FaultSpec(kind, ONSET, **kw),
                    monitor=ScriptedRollback(40, 20), checkpoint_every=10)
    assert res.rollbacks == 1 and res.steps_lost == 20
    assert math.isnan(res.lrs[40])  # the step that asked for the rollback is not taken
    return res.lrs, res


def test_recurrence_after_rollback_follows_each_fault_clock(clean: Any) -> None:
    # iteration i >= 41 runs scheduler step i - 20 after the rollback
    after = range(42, 42 + 8)  # scheduler steps 22..29, all before the onset again
    persistent, _ = _lrs_after_rollback("lr_persistent")
    assert [persistent[i] / clean.lrs[i - 20] for i in after] == pytest.approx([30.0] * 8)
    ramp, _ = _lrs_after_rollback("lr_ramp", duration=10)
    assert [ramp[i] / clean.lrs[i - 20] for i in after] == pytest.approx([1.0] * 8)
    again = [ramp[i] / clean.lrs[i - 20] for i in range(50, 60)]  # steps 30..39: ramp again
    assert again == pytest.approx([1.0 + 19.0 * (k + 1) / 10 for k in range(10)])
    blowup, _ = _lrs_after_rollback("lr_blowup")  # iterations 30..39 only: never again
    assert [blowup[i] / clean.lrs[i - 20] for i in range(42, 80)] == pytest.approx([1.0] * 38)


@pytest.mark.parametrize("duration", [0, 5])
def test_data_corruption_window_and_permanent(duration: int) -> None:
    task = make_task("mlp", seed=3)
    inj = FaultInjector(FaultSpec("data_corruption", ONSET, duration=duration), task,
                        task.make_model())
    for pos in (ONSET - 1, ONSET, ONSET + 4, ONSET + 5, 500):
        x, y = inj.batch(pos)
        x0, y0 = task.batch(pos)
        bad = pos >= ONSET and (duration == 0 or pos < ONSET + duration)
        assert torch.equal(x, x0 * 1e3) == bad
        assert torch.equal(x, x0) != bad


@pytest.mark.parametrize("mag", [8.0, 0.125])
def test_input_shift_scales_mlp_batches_to_the_end(mag: float) -> None:
    task = make_task("mlp", seed=3)
    inj = FaultInjector(FaultSpec("input_shift", ONSET, magnitude=mag), task, task.make_model())
    assert torch.equal(inj.batch(ONSET - 1)[0], task.batch(ONSET - 1)[0])
    for pos in (ONSET, ONSET + 1, 10_000):
        x, y = inj.batch(pos)
        x0, y0 = task.batch(pos)
        assert torch.allclose(x, x0 * mag) and torch.equal(y, y0)
    res = train_run("mlp", STEPS, seed=3, eval_every=0,
                    fault=FaultSpec("input_shift", ONSET, magnitude=mag))
    ref = train_run("mlp", STEPS, seed=3, eval_every=0)
    assert res.losses[:ONSET] == ref.losses[:ONSET]
    assert res.losses[ONSET:] != ref.losses[ONSET:]


def test_input_shift_gpt_token_distribution() -> None:
    task = make_task("gpt", seed=3)
    up = FaultInjector(FaultSpec("input_shift", 5, magnitude=8.0), task, task.make_model())
    x, y = up.batch(7)
    x0, y0 = task.batch(7)
    s, s0 = bytes(x[0].tolist()).decode(), bytes(x0[0].tolist()).decode()
    assert s == s0.swapcase() and s != s0
    assert torch.equal(y[:, :-1], x[:, 1:])  # still a language-modelling batch
    down = FaultInjector(FaultSpec("input_shift", 5, magnitude=0.125), task, task.make_model())
    xd, _ = down.batch(7)
    row = bytes(xd[0].tolist()).decode()
    assert row in prose_text() and not torch.equal(xd, x0)
    assert torch.equal(down.batch(4)[0], task.batch(4)[0])


def test_weight_scale_scales_one_matrix_once() -> None:
    task = make_task("mlp", seed=3)
    net = task.make_model()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    inj = FaultInjector(FaultSpec("weight_scale", 4), task, net)
    inj.before_forward(3)
    inj.before_forward(4)
    inj.before_forward(5)
    changed = [n for n, p in net.named_parameters() if not torch.equal(p, before[n])]
    assert changed == ["0.weight"]
    assert torch.allclose(net.get_parameter("0.weight"), before["0.weight"] * 1e3)


def test_activation_spike_scales_the_block_output_in_its_window() -> None:
    task = make_task("mlp", seed=3)
    net = task.make_model()
    inj = FaultInjector(FaultSpec("activation_spike", 10, duration=3, magnitude=50.0), task, net)
    seen: list[torch.Tensor] = []
    spike_module(net).register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    x, _ = task.batch(0)
    outs = []
    for it in (9, 10, 12, 13):
        inj.before_forward(it)
        outs.append(net(x).detach())
    assert torch.allclose(seen[1], seen[0] * 50.0) and torch.allclose(seen[2], seen[0] * 50.0)
    assert torch.equal(seen[3], seen[0])
    assert not torch.allclose(outs[1], outs[0]) and torch.equal(outs[3], outs[0])
    inj.before_forward(11)
    net.eval()  # evaluation is not affected
    net(x)
    assert torch.equal(seen[-1], seen[0])
    net.train()
    inj.remove()
    inj.before_forward(11)
    net(x)
    assert torch.equal(seen[-1], seen[0])


@pytest.mark.parametrize(("kind", "check"), [
    ("fp16_overflow", lambda g, g0: not torch.isfinite(g).any()),
    ("fp16_underflow", lambda g, g0: torch.allclose(g, g0 * 1e-8, rtol=1e-5, atol=0)),
    ("grad_explosion", lambda g, g0: torch.allclose(g, g0 * 1e4)),
])
def test_gradient_faults_act_on_window_steps_only(kind: str, check: Any) -> None:
    task = make_task("mlp", seed=3)
    net = task.make_model()
    inj = FaultInjector(FaultSpec(kind, 10, duration=3), task, net)
    x, y = task.batch(0)
    for it, inside in ((9, False), (10, True), (12, True), (13, False)):
        net.zero_grad()
        task.loss_fn(net, x, y).backward()
        g0 = [p.grad.clone() for p in net.parameters()]
        inj.after_backward(it)
        for p, g in zip(net.parameters(), g0, strict=True):
            assert check(p.grad, g) if inside else torch.equal(p.grad, g)


def test_fp16_overflow_run_sees_nonfinite_grads_on_window_steps() -> None:
    rec = Recorder()
    res = train_run("mlp", 40, seed=3, eval_every=0, recorder=rec,
                    fault=FaultSpec("fp16_overflow", 20, duration=3))
    gn = [rec.rows[s]["grad_norm"] for s in range(40)]
    assert all(math.isfinite(v) for v in gn[:20])
    assert not any(math.isfinite(v) for v in gn[20:23])
    assert not math.isfinite(res.final_loss)  # no scaler, no monitor: the weights are NaN


def test_faults_are_deterministic_per_seed_and_fault() -> None:
    f = FaultSpec("activation_spike", 20, duration=4)
    a = train_run("mlp", 40, seed=5, eval_every=0, fault=f)
    b = train_run("mlp", 40, seed=5, eval_every=0, fault=f)
    c = train_run("mlp", 40, seed=5, eval_every=0)
    assert a.losses == b.losses and a.final_loss == b.final_loss
    assert a.losses[:20] == c.losses[:20] and a.losses[20] > 2 * c.losses[20]
