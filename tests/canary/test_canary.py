"""The canary set (``attach(..., canary=K, canary_loss=fn)``), with real PyTorch on CPU.

A small regression problem (the one of ``tests/policy/test_invariants.py``), AdamW and a real
``LambdaLR`` schedule through the real :class:`~stability.adapters.torch.TorchGuard` with
``Monitor("small")``.  What must hold: a clean run is bit-identical with and without the canary
(weights, RNG); a stuck loader feeding one corrupt batch for 20 steps (memorised) ends within 2 %
of the clean run and no worse than unguarded; bad data to the end stops with healthy weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

from stability import Monitor  # noqa: E402
from stability.adapters.guard.canary import CanarySet, isolated_eval  # noqa: E402
from stability.adapters.interventions import TrainingStopped  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.policy.attribution import attribute  # noqa: E402
from stability.testing.tasks import warmup_cosine  # noqa: E402
from stability.types import Alarm  # noqa: E402
from tests.policy.test_invariants import STEPS, WINDOW, problem  # noqa: E402

torch.set_num_threads(1)
F = torch.nn.functional
Batch = tuple["torch.Tensor", "torch.Tensor"]


def mse(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def clean(i: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    return x, y


def stuck_loader(i: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    """A stuck loader: one corrupt batch (random targets) repeated at positions WINDOW."""
    if WINDOW[0] <= i < WINDOW[1]:
        g = torch.Generator().manual_seed(5)
        return torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g) * 3
    return x, y


def wrong_to_the_end(i: int, x: torch.Tensor, y: torch.Tensor) -> Batch:
    """Shuffled targets from position 300 to the end, no validation set."""
    if i >= 300:
        g = torch.Generator().manual_seed(i)
        return x, y[torch.randperm(y.shape[0], generator=g)]
    return x, y


def train(fault: Callable[[int, torch.Tensor, torch.Tensor], Batch] = clean,
          monitor: bool = True, canary: int = 4, model_fn: Callable[[], torch.nn.Module] | None
          = None):
    """Train; returns (guard, held-out loss, stop or None, weights per step)."""
    model, xs, ys = problem()
    if model_fn is not None:
        torch.manual_seed(0)
        model = model_fn()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(STEPS, 20))
    kw = {"canary": canary, "canary_loss": mse} if canary else {}
    guard = TorchGuard(model, opt, sched, Monitor("small") if monitor else None,
                       checkpoint_every=25, clip_norm=1.0, **kw)
    weights: dict[int, list[torch.Tensor]] = {}
    stopped = None
    try:
        for i in guard.batches(STEPS):
            x, y = fault(i, xs[i], ys[i])
            guard.offer_batch((x, y))
            loss = F.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss)
            weights[guard.step_count - 1] = [p.detach().clone() for p in model.parameters()]
    except TrainingStopped as e:
        stopped = e
    model.eval()
    with torch.no_grad():
        held = float(F.mse_loss(model(xs[STEPS:].reshape(-1, 16)), ys[STEPS:].reshape(-1, 1)))
    return guard, held, stopped, weights


def acting(guard: TorchGuard) -> list[str]:
    return [f"{i.step}:{i.type}" for i in guard.interventions if i.type != "alert"]


# ------------------------------------------------------------------ invariant 1
def _noisy_model() -> torch.nn.Module:
    """Dropout (RNG) and batch norm (running statistics): what an evaluation could disturb."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))


def test_a_clean_run_is_bit_identical_with_and_without_the_canary() -> None:
    """Invariant 1: the canary evaluates (dropout + batch norm model) and changes nothing --
    weights, batch-norm buffers and the RNG stream are those of the run without it."""
    g, held, stopped, w = train(model_fn=_noisy_model)
    rng_with = torch.get_rng_state()
    g0, held0, _, w0 = train(canary=0, model_fn=_noisy_model)
    rng_without = torch.get_rng_state()
    assert g.canary is not None and g.canary.evaluations >= 20  # it really evaluated
    assert stopped is None and acting(g) == [] and acting(g0) == []
    assert all(torch.equal(a, b) for a, b in zip(w[STEPS - 1], w0[STEPS - 1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(g.model.buffers(), g0.model.buffers(),
                                                  strict=True))
    assert torch.equal(rng_with, rng_without)
    assert held == held0


# ------------------------------------------------------------------ field scenarios
def test_a_memorised_20_batch_window_is_rolled_back_within_2pct_of_clean() -> None:
    """A stuck loader repeats one corrupt batch for 20 steps; the model learns it.  The canary
    sees it at its next evaluation (cause ``data``): one rollback to before the window that
    skips it, ending within 2 % of the clean run and no worse than unguarded."""
    _, c, _, _ = train(canary=0, monitor=False)
    _, a, _, _ = train(stuck_loader, canary=0, monitor=False)
    g, b, stopped, _ = train(stuck_loader)
    assert stopped is None
    rbs = [i for i in g.interventions if i.type == "rollback"]
    assert len(rbs) == 1 and rbs[0].cause == "data" and rbs[0].to_step < WINDOW[0]
    assert set(range(*WINDOW)) <= g.skip_positions
    assert b <= 1.02 * c, (b, c)
    assert b <= a, (b, a)
    assert a > 1.05 * c  # (the fault does matter)


def test_bad_data_to_the_end_stops_with_the_healthy_weights() -> None:
    """Shuffled targets to the end, no validation set: the canary flags it, the rollback skips
    it, the data keeps failing, and the stop restores the healthy weights it names."""
    _, a, _, _ = train(wrong_to_the_end, canary=0, monitor=False)
    g, b, stopped, w = train(wrong_to_the_end)
    assert stopped is not None and "cause: data" in stopped.reason
    assert any(i.type == "rollback" and i.cause == "data" for i in g.interventions)
    r = stopped.restored_step
    assert r is not None and r < 300
    assert all(torch.equal(p.detach(), q) for p, q in zip(g.model.parameters(), w[r],
                                                          strict=True))
    assert b < a


# ------------------------------------------------------------------ the set itself
def test_filling_keeps_copies_and_ends_at_the_first_alarm() -> None:
    c = CanarySet(mse, size=3, every=10)
    x = torch.ones(2, 16)
    assert c.offer((x, torch.zeros(2, 1)), step=0)
    x.add_(1.0)  # the loop reuses its buffer: the kept copy is unchanged
    assert torch.equal(c.batches[0][0], torch.ones(2, 16))
    assert c.offer((x, torch.zeros(2, 1)), step=1)
    assert not c.due(10)  # not full yet, not closed
    c.close(step=1)  # an alarm at step 1: its batch is dropped, no more are kept
    assert len(c.batches) == 1 and c.closed
    assert not c.offer((x, torch.zeros(2, 1)), step=2)
    assert c.due(10) and not c.due(0) and not c.due(15)


def test_the_guard_closes_the_set_on_an_alarm_step() -> None:
    model, xs, ys = problem()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = TorchGuard(model, opt, None, None, canary=8, canary_loss=mse)
    for i in range(3):
        guard.offer_batch((xs[i], ys[i]))
        F.mse_loss(model(xs[i]), ys[i]).backward()
        guard.step(F.mse_loss(model(xs[i]), ys[i]).detach())
    assert guard.canary is not None and len(guard.canary.batches) == 3
    guard.healthy = False  # (what an alarm step leaves behind)
    assert not guard.offer_batch((xs[3], ys[3]))


def test_max_bytes_and_bad_arguments_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    c = CanarySet(mse, size=4, max_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="stability.adapters"):
        assert not c.offer((torch.ones(100, 16), torch.zeros(100, 1)), step=0)
    assert "refused" in caplog.text and c.closed and not c.batches
    for kw in ({"size": 0}, {"every": 0}, {"max_bytes": -1}, {"size": True}):
        with pytest.raises(ValueError, match="parameter of CanarySet"):
            CanarySet(mse, **kw)
    with pytest.raises(ValueError, match="canary_loss"):
        TorchGuard(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=1.0),
                   canary=4)


def test_a_failing_loss_function_disables_the_canary_without_crashing(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        raise RuntimeError("shape mismatch")
    c = CanarySet(broken, size=1, every=1)
    c.offer((torch.ones(2, 16), torch.zeros(2, 1)), step=0)
    with caplog.at_level(logging.WARNING, logger="stability.adapters"):
        assert math.isnan(c.evaluate(torch.nn.Linear(16, 1)))
    assert c.disabled and not c.due(1) and "disabled" in caplog.text


def test_isolated_eval_restores_each_modules_mode_and_the_rng() -> None:
    net = _noisy_model()
    net[3].eval()  # a module the user keeps in eval mode stays so
    state = torch.get_rng_state()
    with isolated_eval(net):
        assert not any(m.training for m in net.modules())
        torch.rand(10)
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in net.modules()] == [True, True, True, True, False, True]


def test_state_round_trip_and_a_refilled_set_continues_at_its_level() -> None:
    c = CanarySet(mse, size=1, every=1)
    c.offer((torch.ones(2, 16), torch.zeros(2, 1)), step=0)
    net = torch.nn.Linear(16, 1)
    v = c.evaluate(net)
    fresh = CanarySet(mse, size=1, every=1)
    fresh.load_state_dict(c.state_dict())
    assert fresh.evaluations == 1 and fresh.last == v
    fresh.offer((torch.ones(2, 16) * 3, torch.ones(2, 1)), step=5)  # other batches
    assert fresh.evaluate(net) == pytest.approx(v)  # rebased onto the restored level
    with pytest.raises(ValueError):
        fresh.load_state_dict({"version": 99})
    with pytest.raises(ValueError):
        fresh.load_state_dict({"version": 1, "scale": -1.0})


def test_a_canary_divergence_is_attributed_to_the_data() -> None:
    a = Alarm(5, "train_val_divergence", "loss,canary_loss", 9.0, 4.0, "warning", "canary_trend")
    v = Alarm(5, "train_val_divergence", "loss,val_loss", 9.0, 4.0, "warning", "train_val")
    kw = {"lr_fault": False, "nonfinite_loss_run": 0, "consecutive": 1, "persistent_after": 8}
    assert attribute([a], **kw) == "data"
    assert attribute([v], **kw) == "divergence"


# ------------------------------------------------------------------ where a data rollback goes
def test_a_data_rollback_goes_before_the_canary_climb_and_survives_the_state_round_trip() -> None:
    """The canary alarms at 225 after climbing since its evaluation at 150: the rollback goes to
    the checkpoint the canary last vouched for (149), not to the latest one (224, which already
    learnt the bad data).  A policy restored from ``state_dict()`` decides the same; without a
    climb on record the latest checkpoint before the alarm is the target."""
    from stability.policy.policy import Policy
    from stability.run.checkpoints import CheckpointLedger
    from stability.types import Control, Rollback

    def run(policy: Policy, notes: bool) -> Rollback:
        led = CheckpointLedger(margin=0)
        for s in (124, 149, 174, 199, 224):
            led.add(s, f"ckpt-{s}")
        if notes:
            for step, v in ((100, 0.3), (125, 0.2), (150, 0.15), (175, 0.4), (200, 0.9)):
                policy.note_canary(step, v)
        a = Alarm(225, "train_val_divergence", "canary_loss", 5.0, 3.0, "warning",
                  "canary_level")
        ivs = policy.step(225, [a], Control(), {"healthy_checkpoints": led})
        return next(i for i in ivs if isinstance(i, Rollback))

    pol = Policy()
    rb = run(pol, notes=True)
    assert rb.cause == "data" and rb.to_step == 149
    assert pol.canary.low_step == -1 or pol.canary.low_step <= 149  # rewound with the rollback
    fresh, ref = Policy(), Policy()
    for step, v in ((100, 0.3), (125, 0.2), (150, 0.15), (175, 0.4), (200, 0.9)):
        ref.note_canary(step, v)
    fresh.load_state_dict(ref.state_dict())
    assert fresh.canary.low_step == 150 and fresh.canary.last == 0.9
    assert run(fresh, notes=False).to_step == 149
    assert 150 in ref.rollback_anchors()  # retention keeps the checkpoint it vouched for
    assert run(Policy(), notes=False).to_step == 224


def test_canary_batches_round_trip_and_bad_input_is_refused() -> None:
    c = CanarySet(mse, size=2, every=1)
    c.offer((torch.ones(2, 16), torch.zeros(2, 1)), step=0)
    c.offer((torch.zeros(2, 16), torch.ones(2, 1)), step=1)
    net = torch.nn.Linear(16, 1)
    v = c.evaluate(net)
    fresh = CanarySet(mse, size=2, every=1)
    fresh.load_batches(c.batches_state())
    fresh.load_state_dict(c.state_dict())
    assert fresh.full and fresh.steps == [0, 1] and fresh.evaluate(net) == v  # no rebase
    with pytest.raises(ValueError):
        CanarySet(mse, size=1).load_batches(c.batches_state())  # more batches than the size
    with pytest.raises(ValueError):
        fresh.load_batches({"batches": [1], "steps": []})
