"""``TorchGuard(sync="deferred")``: no host sync on the step path, decisions one step late."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.interventions import TrainingStopped  # noqa: E402
from stability.adapters.torch import TorchGuard, find_ledger  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.testing.tinytrain import FaultSpec, train_run  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

from . import gloo  # noqa: E402
from .scripted import ScriptedMonitor, watch  # noqa: E402

torch.set_num_threads(1)


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, dict(metrics)))


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _run(sync: str, n: int = 40, **kw: Any) -> dict[str, Any]:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    mon = Monitor("small")
    seen = watch(mon)
    rec = _Recorder()
    guard = TorchGuard(model, opt, sched, mon, checkpoint_every=7, recorder=rec, sync=sync,
                       activations=["1"], activation_every=3, log_interventions=False, **kw)
    decisions: dict[int, dict[str, Any]] = {}
    for i in guard.batches(n):
        x, y = _batch(i)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        d = guard.step(loss)
        if d.step >= 0:
            decisions[d.step] = d.to_dict()
    last = guard.flush()
    if last is not None:
        decisions[last.step] = last.to_dict()
    ledger = [(r.step, r.healthy, r.reason) for r in find_ledger(mon).records]
    return {"seen": seen, "rows": rec.rows, "decisions": decisions, "ledger": ledger,
            "weights": [p.detach().clone() for p in model.parameters()], "guard": guard}


def test_healthy_run_identical_signal_stream_decisions_and_checkpoints() -> None:
    a, b = _run("step"), _run("deferred")
    assert [s for s, _, _ in a["seen"]] == list(range(40))
    assert b["seen"] == a["seen"]  # same steps, same values (families included), same order
    assert b["rows"] == a["rows"]  # the recorder gets the same rows
    assert sorted(b["decisions"]) == list(range(40)) and b["decisions"] == a["decisions"]
    assert any("update_ratio" in f for _, _, f in a["seen"])
    assert any("act_mean" in f for _, _, f in a["seen"])
    assert b["ledger"] == a["ledger"] and len(a["ledger"]) >= 4  # same checkpoints, same health
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        assert torch.equal(wa, wb)  # no intervention: the very same training


class _Syncs:
    """Counts calls of tensor methods that synchronise with a device (while ``active``)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")

    def __init__(self) -> None:
        self.active = False
        self.calls = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Syncs]:
        orig = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(fn: Any) -> Any:
            def counted(t: Any, *a: Any, **k: Any) -> Any:
                if self.active:
                    self.calls += 1
                return fn(t, *a, **k)
            return counted

        for n, fn in orig.items():
            setattr(torch.Tensor, n, wrap(fn))
        try:
            yield self
        finally:
            for n, fn in orig.items():
                setattr(torch.Tensor, n, fn)


@pytest.mark.parametrize("sync,expected", [("step", 1), ("deferred", 0), ("auto", 1)])
def test_host_syncs_between_backward_and_optimizer_step(sync: str, expected: int) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=0, sync=sync,
                       clip_norm=1.0, activations=["1"], activation_every=2,
                       log_interventions=False)
    per_check, per_step = [], []
    with _Syncs().installed() as c:
        for i in range(12):
            x, y = _batch(i)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            c.calls, c.active = 0, True
            guard.check(loss)
            c.active = False
            per_check.append(c.calls)
            c.active = True
            if guard.should_step:
                opt.step()
            opt.zero_grad(set_to_none=True)
            guard.finish()
            c.active = False
            per_step.append(c.calls)
    steady = slice(2, None)  # (the first steps allocate the reused host buffers)
    assert per_check[steady] == [expected] * 10
    assert guard.sync_mode == ("deferred" if sync == "deferred" else "step")  # auto: CPU
    if sync == "deferred":  # fused AdamW: nothing in the whole step reads the device
        assert per_step[steady] == [0] * 10


def _nan_step(opt_factory: Any, clip: float | None = None) -> tuple[Any, ...]:
    model = _mlp()
    opt = opt_factory(model.parameters())
    guard = TorchGuard(model, opt, None, None, checkpoint_every=0, sync="deferred",
                       clip_norm=clip)
    for i in range(4):
        x, y = _batch(i)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        guard.step(None)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(4)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    first = next(model.parameters())
    first.grad[0, 0] = math.nan  # one non-finite gradient element
    first.grad[1, 1] = math.inf
    guard.step(None)
    after = [p.detach().clone() for p in model.parameters()]
    for i in range(5, 8):  # training goes on normally
        x, y = _batch(i)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        guard.step(None)
    guard.flush()
    return model, opt, before, after


@pytest.mark.parametrize("kind", ["adamw-fused", "sgd-fused"])
def test_nan_gradient_step_is_skipped_on_the_device(kind: str) -> None:
    factory = {"adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
               "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)}
    model, opt, before, after = _nan_step(factory[kind], clip=1.0)
    assert opt._step_supports_amp_scaling and not hasattr(opt, "found_inf")
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)  # the fused kernel skipped the update entirely
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if kind == "adamw-fused":  # nor did the state step: 7 real steps out of 8
        assert all(int(s["step"]) == 7 for s in opt.state.values())


@pytest.mark.parametrize("foreach", [False, True])
def test_nan_gradient_never_reaches_the_weights_without_fused_kernels(foreach: bool) -> None:
    model, opt, before, after = _nan_step(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=foreach))
    for b, a in zip(before, after, strict=True):
        assert torch.isfinite(a).all()
        # zeroed gradients: only momentum and weight decay moved the weights (by ~lr)
        assert (a - b).abs().max() < 2e-2
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(s["exp_avg"]).all() for s in opt.state.values())


def test_device_clip_is_the_tightest_of_guard_and_control() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)

    class _Clip:
        def observe(self, step: int, metrics: Any = None, families: Any = None) -> Decision:
            return Decision(step, control=Control(clip_norm=0.01, lr_factor=0.5))

    guard = TorchGuard(m, opt, None, _Clip(), checkpoint_every=0, update_ratio_every=0,
                       clip_norm=0.1, sync="deferred")
    deltas = []
    for _ in range(3):
        w0 = m.weight.detach().clone()
        (m(torch.ones(1, 2)).sum() * 100).backward()
        guard.step(None)
        deltas.append(float((m.weight.detach() - w0).norm()))
    # step 0: the guard's own clip (nothing observed yet); from step 1: step 0's decision
    assert deltas[0] == pytest.approx(0.1, rel=1e-4)
    assert deltas[1:] == pytest.approx([0.5 * 0.01] * 2, rel=1e-4)


def _scripted(sync: str, script: dict[int, Control], n: int = 12) -> tuple[Any, ...]:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mon = ScriptedMonitor(dict(script))
    guard = TorchGuard(m, opt, sched, mon, checkpoint_every=2, sync=sync)
    used, weights = [], {}
    try:
        for i in guard.batches(n):
            used.append(i)
            g = torch.Generator().manual_seed(i)
            loss = m(torch.randn(4, 3, generator=g)).pow(2).mean()
            loss.backward()
            guard.step(loss)
            weights[guard.step_count - 1] = m.weight.detach().clone()
        guard.flush()
    except TrainingStopped as e:
        return guard, mon, used, weights, e
    return guard, mon, used, weights, None


def test_late_rollback_matches_step_mode_bookkeeping() -> None:
    script = {7: Control(save_checkpoint=True, rollback_to=4, skip_batches=(5, 7))}
    a = _scripted("step", script)
    b = _scripted("deferred", script)
    ga, gb = a[0], b[0]
    assert b[1].seen == a[1].seen  # the monitor sees the same steps
    assert b[1].seen[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 5]
    for attr in ("rollbacks", "steps_lost", "batches_skipped", "steps_skipped", "step_count",
                 "data_position"):
        assert getattr(gb, attr) == getattr(ga, attr), attr
    # the batch after step 7 was computed, then thrown away with the rollback (voided step)
    assert a[2][:9] == list(range(9)) and b[2][:10] == [*range(9), 8]
    # checkpoints: the same steps with the same health, the emergency one of step 7 included
    recs = [(r.step, r.healthy) for r in find_ledger(b[1]).records]
    assert recs == [(r.step, r.healthy) for r in find_ledger(a[1]).records]


def test_late_stop_keeps_the_weights_of_the_stop_step() -> None:
    a = _scripted("step", {5: Control(stop=True, stop_reason="enough")})
    b = _scripted("deferred", {5: Control(stop=True, stop_reason="enough")})
    assert a[4] is not None and b[4] is not None
    assert b[4].step == a[4].step == 5 and b[4].reason == "enough"
    assert b[0].step_count == a[0].step_count == 6
    assert b[0].data_position == a[0].data_position
    # step 5's update landed before its stop was known; step 6's was not applied
    assert torch.equal(b[0].model.weight, b[3][5])


def test_late_skip_is_not_carried_over_to_the_next_step() -> None:
    a = _scripted("step", {3: Control(skip_step=True)})
    b = _scripted("deferred", {3: Control(skip_step=True)})
    assert a[0].steps_skipped == 1 and not torch.equal(a[3][3], b[3][3])
    assert b[0].deferred.late_skips == 1
    assert not torch.equal(b[3][3], b[3][2]) and not torch.equal(b[3][4], b[3][3])
    assert b[1].seen == a[1].seen == list(range(12))


def test_lr_blowup_and_bit_flip_rescued_like_step_mode() -> None:
    clean = train_run("mlp", 140, seed=0)
    for kind in ("lr_blowup", "bit_flip"):
        fault = FaultSpec(kind, 100)
        broken = train_run("mlp", 140, seed=0, fault=fault)
        step = train_run("mlp", 140, seed=0, fault=fault, monitor=Monitor("small"))
        late = train_run("mlp", 140, seed=0, fault=fault, monitor=Monitor("small"),
                         guard_kwargs={"sync": "deferred"})
        assert not math.isfinite(broken.final_loss) or broken.final_loss > 1.3 * clean.final_loss
        assert late.acting_interventions(), kind  # the guard intervened
        assert [iv.type for iv in late.acting_interventions()] == \
            [iv.type for iv in step.acting_interventions()]
        assert late.rollbacks == step.rollbacks
        assert math.isfinite(late.final_loss)
        assert abs(late.final_loss / clean.final_loss - 1) < 0.02, kind
        assert abs(late.final_loss / step.final_loss - 1) < 0.02, kind


def _copy_run(model: torch.nn.Module, opt: Any, sched: Any) -> tuple[Any, ...]:
    m2 = copy.deepcopy(model)
    o2 = torch.optim.AdamW(m2.parameters(), lr=3e-3)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: min(1.0, (s + 1) / 10))
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))  # (after the scheduler wrote its LR)
    s2.load_state_dict(sched.state_dict())
    return m2, o2, s2


def test_state_dict_round_trip_with_a_pending_step() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    mon = Monitor("small")
    seen_a = watch(mon)
    ga = TorchGuard(model, opt, sched, mon, checkpoint_every=0, sync="deferred",
                    log_interventions=False, update_ratio_every=1)

    def train(guard: TorchGuard, m: torch.nn.Module, batches: range) -> list[dict]:
        out = []
        for i in batches:
            x, y = _batch(i)
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            out.append(guard.step(loss).to_dict())
        return out

    train(ga, model, range(8))
    assert ga.deferred.pending is not None and ga.deferred.pending.step == 7
    sd = json.loads(json.dumps(ga.state_dict()))
    assert sd["deferred"]["pending"]["step"] == 7
    assert [s for s, _, _ in seen_a] == list(range(7))  # state_dict() observed nothing
    m2, o2, s2 = _copy_run(model, opt, sched)
    mon_b = Monitor("small")
    seen_b = watch(mon_b)
    gb = TorchGuard(m2, o2, s2, mon_b, checkpoint_every=0, sync="deferred",
                    log_interventions=False, update_ratio_every=1)
    gb.load_state_dict(sd)
    assert gb.step_count == 8 and gb.deferred.pending.step == 7
    da, db = train(ga, model, range(8, 14)), train(gb, m2, range(8, 14))
    assert db == da and db[0]["step"] == 7  # the restored guard observes step 7 first
    fa, fb = ga.flush(), gb.flush()
    assert fa is not None and fb is not None and fa.to_dict() == fb.to_dict()
    assert [s for s, _, _ in seen_b] == list(range(7, 14))
    # (as with sync="step", the update ratio of the update before a restore is not carried)
    assert "update_ratio" in seen_a[8][2] and "update_ratio" not in seen_b[1][2]
    seen_a[8][2].pop("update_ratio")
    assert seen_b == seen_a[7:]
    assert ga.flush() is None  # nothing left


def test_detach_flushes_and_a_late_stop_is_kept() -> None:
    guard, mon, _, _, err = _scripted("deferred", {}, n=6)
    assert err is None and mon.seen == list(range(6))  # flush() observed the last step
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon2 = ScriptedMonitor({3: Control(stop=True, stop_reason="late")})
    g2 = TorchGuard(m, opt, None, mon2, checkpoint_every=0, sync="deferred")
    for _ in range(4):
        m(torch.ones(2, 3)).sum().backward()
        g2.step(None)
    assert mon2.seen == [0, 1, 2]
    g2.detach()  # observes step 3 and never raises on the way out
    assert mon2.seen == [0, 1, 2, 3] and g2.stopped is not None and g2.stopped.step == 3


def test_sync_argument_is_checked() -> None:
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'sync'"):
        TorchGuard(m, opt, sync="later")
    import stability.torch

    guard = stability.torch.attach(m, opt, sync="deferred")
    assert guard.sync_mode == "deferred" and guard.deferred is not None
    assert TorchGuard(m, opt).sync_mode == "auto"  # the default: resolved at the first step
    m(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match="deferred"):
        guard.check(None, signals=guard.collect(None))


def _rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    with gloo.process_group(rank, world, port):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=10,
                           sync="deferred", log_interventions=False)
        log = []
        for i in guard.batches(70):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x = torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            if rank == 1 and i == 50:
                loss = loss * float("nan")  # only rank 1 sees it
            loss.backward()
            gloo.average_gradients(model, world)
            at = guard.step_count
            d = guard.step(loss)
            c = guard.control
            log.append([at, d.step, c.skip_step, c.rollback_to, c.lr_factor, c.clip_norm,
                        guard.healthy, guard.should_step])
        guard.flush()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"log": log, "w": [float(p.detach().sum()) for p in model.parameters()],
                       "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                       "rollbacks": guard.rollbacks}, fh)
    os._exit(0)  # (see tests/adapters/test_distributed.py: torch's gloo teardown)


def test_two_ranks_take_the_same_late_decisions(tmp_path: Any) -> None:
    r0, r1 = gloo.run_ranks(_rank_worker, 2, tmp_path)
    assert r0["log"] == r1["log"]  # the same decision at the same step on both ranks
    # step 50's decision (NaN on rank 1 only) is observed during step 51, on both ranks
    seen = [row for row in r0["log"] if row[1] == 50]
    assert len(seen) == 1 and seen[0][0] == 51 and seen[0][6] is False
    assert r0["finite"] and r1["finite"]  # the NaN gradients never reached the weights
    assert r0["w"] == pytest.approx(r1["w"]) and r0["rollbacks"] == r1["rollbacks"]


def _fp16(sync: str, n: int = 40) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows until it comes down
    rec = _Recorder()
    guard = TorchGuard(model, opt, None, Monitor("small"), scaler=scaler, recorder=rec,
                       checkpoint_every=0, sync=sync, log_interventions=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randn(32, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        scaler.scale(loss).backward()
        guard.step(loss)
    guard.flush()
    return guard, rec, [p.detach().clone() for p in model.parameters()]


def test_fp16_scaler_overflow_steps_like_step_mode() -> None:
    (ga, ra, wa), (gb, rb, wb) = _fp16("step"), _fp16("deferred")
    over = [s for s, r in ra.rows if r.get("amp_overflow") == 1.0]
    assert len(over) >= 10 and ga.amp_overflows == gb.amp_overflows == len(over)
    assert rb.rows == ra.rows  # overflow steps: no grad norms; the step after: no update ratio
    assert all(torch.equal(a, b) for a, b in zip(wa, wb, strict=True))


def test_a_bad_pending_snapshot_is_refused_before_anything_changes() -> None:
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    guard = TorchGuard(m, opt, sync="deferred")
    for _ in range(2):
        m(torch.ones(1, 2)).sum().backward()
        guard.step(None)
    sd = json.loads(json.dumps(guard.state_dict()))
    bad = copy.deepcopy(sd)
    bad["deferred"]["pending"]["scalars"]["grad_norm"] = "high"
    bad["step"] = 40
    with pytest.raises(ValueError, match="deferred.pending.scalars.grad_norm"):
        guard.load_state_dict(bad)
    assert guard.step_count == 2 and guard.deferred.pending.step == 1
    bad = copy.deepcopy(sd)
    bad["deferred"]["control"]["lr_factor"] = -1.0
    with pytest.raises(ValueError, match="lr_factor"):
        guard.load_state_dict(bad)
    sd["deferred"]["pending"]["scalars"]["grad_norm"] = "nan"  # non-finite values as text
    guard.load_state_dict(sd)
    assert math.isnan(guard.deferred.pending.signals().scalars["grad_norm"])


@pytest.mark.parametrize("spike_factor", [10.0, None])
def test_spike_clip_bounds_a_gradient_spike_it_is_too_late_to_skip(spike_factor: Any) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = TorchGuard(model, opt, None, Monitor("small"), checkpoint_every=0, sync="deferred",
                       log_interventions=False, raise_on_stop=False)
    guard.deferred.spike_factor = spike_factor
    guard.collector.param_norm_every = 1  # weight_jump warms up on 20 values: 1 per step here
    norms, steps = [], []
    for i in range(30):
        x, y = _batch(i)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if i == 25:
            for p in model.parameters():
                p.grad.mul_(1e4)  # a gradient spike: the skip decided for it comes a step late
        norms.append(float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()))
        w0 = [p.detach().clone() for p in model.parameters()]
        guard.step(loss)
        steps.append(float(torch.stack([(p.detach() - w).norm()
                                        for p, w in zip(model.parameters(), w0,
                                                        strict=True)]).norm()))
        if guard.stopped is not None:
            break
    # clipped at 10x the median of the healthy norms observed by then (steps 0..24), SGD lr 1e-2
    bound = 10.0 * statistics.median(norms[:25]) * 1e-2
    if spike_factor is None:  # the whole spike landed: weights corrupted, the run stopped
        assert steps[25] > 1e3 * max(steps[:25]) and guard.stopped is not None
        return
    guard.flush()
    assert guard.stopped is None and len(steps) == 30
    assert steps[25] == pytest.approx(bound, rel=1e-4)
    assert steps[:25] == pytest.approx([n * 1e-2 for n in norms[:25]], rel=1e-4)  # unclipped
    assert guard.deferred.late_skips >= 1  # the policy asked to skip it, too late
    sd = guard.state_dict()["deferred"]  # the healthy norms travel with the state
    assert sd["grad_norms"] == pytest.approx(norms[:25] + norms[26:], rel=1e-6)
