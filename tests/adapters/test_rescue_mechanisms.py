"""Regression tests of the mechanisms behind issue 10 (interventions that save runs).

Real PyTorch on CPU, real schedulers, the real :class:`TorchGuard`: each test pins one way the
first-round policy lost runs it should have saved.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stability import Monitor  # noqa: E402
from stability.adapters.interventions import CheckpointStore  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.policy.policy import Policy  # noqa: E402
from stability.run.checkpoints import CheckpointLedger  # noqa: E402
from stability.testing.tasks import warmup_cosine  # noqa: E402
from stability.types import Alarm, Control  # noqa: E402

torch.set_num_threads(1)
STEPS = 300
ONSET = 150



def make_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(16, 1, generator=g)
    xs = torch.randn(STEPS * 2, 32, 16, generator=g)
    ys = xs @ w_true + 0.1 * torch.randn(STEPS * 2, 32, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, xs, ys


def run(lr_fault=None, input_scale=None, monitor=True, steps=STEPS, seed=0, **guard_kw):
    """Train with an optional LR fault ``lr_fault(step) -> multiplier`` on the schedule."""
    model, xs, ys = make_problem(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    base = warmup_cosine(steps, 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: base(s) * (lr_fault(s) if lr_fault else 1.0))
    guard = TorchGuard(model, opt, sched, Monitor("small") if monitor else None,
                       checkpoint_every=25, **guard_kw)
    eff: dict[int, float] = {}
    opt.register_step_pre_hook(
        lambda o, a, k: eff.__setitem__(guard.step_count, o.param_groups[0]["lr"]))
    stopped = None
    try:
        for i in guard.batches(steps):
            x, y = xs[i], ys[i]
            if input_scale is not None and i >= ONSET:
                x = x * input_scale
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss)
    except Exception as e:  # TrainingStopped
        stopped = e
    healthy = {s: 3e-3 * base(s) for s in range(steps)}
    return guard, eff, healthy, stopped


def test_permanent_lr_x30_keeps_effective_lr_healthy_to_the_end() -> None:
    guard, eff, healthy, stopped = run(lambda s: 30.0 if s >= ONSET else 1.0)
    assert stopped is None
    after = [s for s in eff if s >= ONSET]
    assert after, "the run must go past the fault"
    ratios = np.array([eff[s] / healthy[s] for s in after])
    assert ratios.max() <= 1.3, ratios.max()          # never the faulty LR, not even once
    assert 0.7 <= ratios[-1] <= 1.3                    # to the end: the cut did not wear off
    assert guard.monitor.policy.guard.active           # still held while the scheduler asks
    causes = {i.cause for i in guard.interventions if i.type == "reduce_lr"}
    assert causes == {"lr"}


def test_ramp_to_a_20x_peak_is_capped() -> None:
    def ramp(s: int) -> float:
        return 1.0 if s < ONSET else min(20.0, 1.0 + 19.0 * (s - ONSET) / 50)
    guard, eff, healthy, stopped = run(ramp)
    assert stopped is None
    cap = 1.3 * healthy[ONSET - 1]
    assert max(eff[s] for s in eff if s >= ONSET) <= cap


def test_healthy_run_is_never_touched_and_lr_is_exact() -> None:
    guard, eff, healthy, stopped = run(None)
    assert stopped is None
    assert [i for i in guard.interventions if i.type != "alert"] == []
    assert all(eff[s] == pytest.approx(healthy[s]) for s in eff)


def test_windowed_schedule_bug_is_released_when_the_lr_returns() -> None:
    guard, eff, healthy, stopped = run(lambda s: 30.0 if ONSET <= s < ONSET + 40 else 1.0)
    assert stopped is None
    assert max(eff[s] / healthy[s] for s in eff if s >= ONSET) <= 1.3
    late = [s for s in eff if s >= ONSET + 45]
    # back to the healthy schedule right away (no cut lingering after the fault)
    assert all(eff[s] == pytest.approx(healthy[s]) for s in late)
    assert not guard.monitor.policy.guard.active


def test_persistent_input_shift_bounded_skips_and_no_stop() -> None:
    guard, eff, healthy, stopped = run(input_scale=8.0)
    assert stopped is None
    n = guard.monitor.policy.config.recovery.max_consecutive_skips
    skips = sorted(i.step for i in guard.interventions if i.type == "skip_step")
    longest = run_len = 0
    for a, b in zip([None] + skips, skips, strict=False):
        run_len = run_len + 1 if a is not None and b == a + 1 else 1
        longest = max(longest, run_len)
    assert longest <= n
    assert guard.rollbacks == 0


# ------------------------------------------------------------------ checkpoints and rollbacks
def test_retention_keeps_the_rollback_target() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dropped = []
    store = CheckpointStore(None, keep=2, on_drop=dropped.append)
    for s in (100, 200, 300):
        store.save(model, opt, None, step=s, data_position=s, healthy=True,
                   protect={100} if s == 300 else ())
    assert sorted(store.entries) == [100, 200, 300]          # 100 protected
    store.save(model, opt, None, step=310, data_position=310, healthy=False)
    store.save(model, opt, None, step=320, data_position=320, healthy=False)
    # emergency checkpoints never evict healthy ones; only the newest emergency one is kept
    assert sorted(store.entries) == [200, 300, 320]
    assert dropped == [100, 310]


def test_ledger_forgets_deleted_checkpoints_so_rollbacks_target_existing_ones() -> None:
    model, xs, ys = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor("small")
    guard = TorchGuard(model, opt, None, mon, checkpoint_every=10, keep_checkpoints=2)
    for i in guard.batches(60):
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        loss.backward()
        guard.step(loss)
    ledger_steps = {r.step for r in mon.checkpoints.records}
    assert ledger_steps == set(guard.store.entries)


def test_refused_rollback_is_not_counted() -> None:
    led = CheckpointLedger()
    led.add(50, "ckpt-50")
    pol = Policy({"ladder": [["alert", "checkpoint", "rollback"]], "max_rollbacks": 1})
    ctl = Control()
    al = [Alarm(100, "loss_spike", "loss", 9.0, 6.0, "critical", "d")]
    ivs = pol.step(100, al, ctl, {"healthy_checkpoints": led})
    assert "rollback" in [i.type for i in ivs] and pol.n_rollbacks == 1
    pol.rollback_failed(100)
    assert pol.n_rollbacks == 0
    # the guard reports a rollback it cannot carry out
    model, xs, ys = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = Monitor("small")
    guard = TorchGuard(model, opt, None, mon, checkpoint_every=0)
    mon.policy.n_rollbacks = 1
    assert guard.rollback(5) is False
    assert mon.policy.n_rollbacks == 0


def test_scheduler_rewind_is_not_an_lr_jump() -> None:
    mon = Monitor("small")
    f = warmup_cosine(400, 20)
    def metrics(s: int) -> dict[str, float]:
        # the weight norm grows slowly: restoring step 199 moves it back by ~25 %
        return {"loss": 1.0 / (1 + s / 100), "lr": 3e-3 * f(s), "param_norm": 1.0 + s / 100}

    for s in range(300):
        mon.observe(s, metrics(s))
    mon.rewind(199)  # a rollback to the checkpoint of step 199: the scheduler goes back
    acting, alarms = [], []
    for s in range(200, 260):
        d = mon.observe(s, metrics(s))
        acting += [i for i in d.interventions if i.type != "alert"]
        alarms += [a for a in d.alarms if a.kind in ("weight_corruption", "lr_loss_anomaly")]
    assert acting == [] and alarms == []
    assert not mon.policy.guard.active


def test_one_warning_after_a_rollback_does_not_stop() -> None:
    led = CheckpointLedger()
    led.add(50, "ckpt-50")
    pol = Policy()
    ctl = Control()
    nan = [Alarm(s, "nonfinite", "loss", math.nan, 0.0, "critical", "nonfinite")
           for s in (100, 101)]
    pol.track(100, 1e-3, math.nan)
    pol.step(100, nan[:1], ctl, {"healthy_checkpoints": led})
    ctl.reset_step()
    pol.track(101, 1e-3, math.nan)
    ivs = pol.step(101, nan[1:], ctl, {"healthy_checkpoints": led})
    assert "rollback" in [i.type for i in ivs] and ivs[0].cause == "corruption"
    ctl.reset_step()
    pol.track(61, 1e-3, 0.5)
    ivs = pol.step(61, [Alarm(61, "loss_spike", "loss", 7.0, 6.0, "warning", "d")], ctl,
                   {"healthy_checkpoints": led, "grad_norm_recent_median": 1.0})
    assert [i.type for i in ivs] == ["alert", "set_clip"] and not ctl.stop


def test_bit_flip_rolls_back_once_without_skipping_batches_or_an_lr_echo() -> None:
    from stability.testing.tinytrain import FaultSpec, train_run

    clean = train_run("mlp", 200, seed=1)
    res = train_run("mlp", 200, seed=1, fault=FaultSpec("bit_flip", 120), monitor=Monitor("small"))
    assert res.stopped is None and res.rollbacks == 1
    assert res.batches_skipped == 0            # the weights were the problem, not the data
    rb = [i for i in res.interventions if i.type == "rollback"]
    assert [i.cause for i in rb] == ["corruption"]
    # the rewound scheduler is not mistaken for an LR fault after the rollback
    assert not [i for i in res.interventions if i.type == "reduce_lr" and i.step >= rb[0].step]
    assert res.final_loss <= 1.05 * clean.final_loss


def test_data_source_that_keeps_failing_stops_with_the_good_weights_restored() -> None:
    from stability.testing.tinytrain import FaultSpec, train_run

    clean = train_run("mlp", 400, seed=0)
    fault = FaultSpec("data_corruption", 200, 0)            # garbage batches to the end
    bare = train_run("mlp", 400, seed=0, fault=fault)
    res = train_run("mlp", 400, seed=0, fault=fault, monitor=Monitor("small"))
    # garbage the model memorises makes the training loss fall: the probation (training loss
    # only) sees a run closing its gap and lets it go on (invariant 3); the validation points
    # then show the memorisation -- either way the run stops with the pre-fault weights
    assert res.stopped is not None and ("data source keeps failing" in res.stopped
                                        or "overfitting" in res.stopped)
    stop = next(i for i in res.interventions if i.type == "stop")
    assert stop.cause in ("outlier", "shift", "overfit")
    restored = re.search(r"weights of step (\d+) restored", res.stopped)
    assert restored is not None and int(restored.group(1)) < 200  # from before the fault
    # stopped with the pre-fault weights, far better than training on garbage to the end
    assert res.final_loss < bare.final_loss
    assert res.final_loss <= 1.1 * clean.final_loss
    # a bad window (the data recovers) never stops the run
    win = train_run("mlp", 400, seed=0, fault=FaultSpec("data_corruption", 200),
                    monitor=Monitor("small"))
    assert win.stopped is None


def _resumable(tmp_path, guard_state=None, weights=None, nan_at=None, steps=60):
    model, xs, ys = make_problem()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if weights is not None:                      # the user's own resume: model + optimizer
        model.load_state_dict(weights[0])
        opt.load_state_dict(weights[1])
    mon = Monitor("small")
    guard = TorchGuard(model, opt, None, mon, checkpoint_dir=tmp_path / "ckpt",
                       checkpoint_every=10)
    if guard_state is not None:
        guard.load_state_dict(guard_state)
    injected = False
    for i in guard.batches(steps):
        if nan_at is not None and guard.step_count == nan_at and not injected:
            injected = True                      # a one-off corruption (it does not recur)
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = math.nan
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        loss.backward()
        guard.step(loss)
    return guard


def test_rollback_after_a_resume_finds_checkpoints_written_before_it(tmp_path) -> None:
    import copy
    import json

    first = _resumable(tmp_path, steps=55)
    saved = json.loads(json.dumps(first.state_dict()))
    weights = (copy.deepcopy(first.model.state_dict()),
               copy.deepcopy(first.optimizer.state_dict()))
    before = sorted(first.store.entries)
    assert before and (tmp_path / "ckpt" / "index.json").is_file()
    # a new process: fresh objects on the same checkpoint directory, resumed by the user
    second = _resumable(tmp_path, guard_state=saved, weights=weights, nan_at=57, steps=70)
    rb = [i for i in second.interventions if i.type == "rollback"]
    assert [i.cause for i in rb] == ["corruption"]
    assert rb[0].to_step in before                # a checkpoint written before the resume
    assert second.rollbacks == 1 and all(
        torch.isfinite(p).all() for p in second.model.parameters())


def test_overfitting_is_early_stopped_with_the_best_checkpoint_restored() -> None:
    from stability.testing.tinytrain import FaultSpec, train_run

    fault = FaultSpec("overfit", 200)                     # the loader sticks to a tiny pool
    bare = train_run("mlp", 400, seed=0, fault=fault)
    res = train_run("mlp", 400, seed=0, fault=fault, monitor=Monitor("small"))
    assert res.stopped is not None and "overfitting" in res.stopped
    assert [i.cause for i in res.interventions if i.type == "stop"] == ["overfit"]
    restore = [i for i in res.interventions if i.type == "rollback"]
    assert len(restore) == 1 and restore[0].to_step <= 225   # around the best validation point
    assert res.final_loss < 0.7 * bare.final_loss
    # a clean run with the same validation cadence is never stopped
    assert train_run("mlp", 400, seed=0, monitor=Monitor("small")).stopped is None
