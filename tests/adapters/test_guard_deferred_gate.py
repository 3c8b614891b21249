"""The skip gate of ``TorchGuard(sync="deferred")``: a late ``skip_step`` skips the next bad batch
on the device (:mod:`stability.adapters.guard.deferred_gate`)."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.guard import deferred as deferred_mod  # noqa: E402
from stability.adapters.guard.deferred_gate import LOSS_MIN, SkipGate  # noqa: E402
from stability.adapters.torch import TorchGuard  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.run.checkpoints import CheckpointLedger  # noqa: E402
from stability.testing.tinytrain import FaultSpec, train_run  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

from . import gloo  # noqa: E402

torch.set_num_threads(1)

N = LOSS_MIN + 4  # steps: the gate knows LOSS_MIN healthy losses from step LOSS_MIN on
SKIP = N - 3  # the scripted skip_step; the bad batch is the next one


class _Scripted:
    """A monitor that asks for ``skip_step`` at the scripted steps."""

    def __init__(self, skips: set[int]) -> None:
        self.skips = skips
        self.checkpoints = CheckpointLedger()

    def observe(self, step: int, metrics: Any = None, families: Any = None) -> Decision:
        return Decision(step, control=Control(skip_step=step in self.skips))

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1}

    def load_state_dict(self, sd: Any) -> None:
        pass


def _opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.AdamW(params, lr=1e-2, foreach=True)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _train(kind: str, skips: set[int], bad: float, *, snap_at: int | None = None,
           gate: bool = True) -> dict[str, Any]:
    """``N`` steps of a small MLP; step ``SKIP + 1``'s loss (and gradients) times ``bad``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = _opt(kind, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = TorchGuard(model, opt, sched, _Scripted(skips), checkpoint_every=0, sync="deferred",
                       update_ratio_every=1)
    if not gate:
        guard.deferred.gate.factor = None
    before: dict[int, list[torch.Tensor]] = {}
    after: dict[int, list[torch.Tensor]] = {}
    snap = None
    for i in range(N):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if i == SKIP + 1:
            loss = loss * bad
        loss.backward()
        before[i] = _state(model, opt)
        guard.step(loss)
        after[i] = _state(model, opt)
        if i == snap_at:
            snap = json.loads(json.dumps(guard.state_dict())), copy.deepcopy(model), \
                copy.deepcopy(opt.state_dict())
    guard.flush()
    return {"before": before, "after": after, "guard": guard, "snap": snap}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw_fused", "adamw_foreach"])
def test_a_bad_batch_after_a_late_skip_is_skipped_exactly(kind: str) -> None:
    r = _train(kind, {SKIP}, 1e3)
    t = SKIP + 1
    # the weights and the whole optimizer state (momentum, Adam moments and step count) are
    # those before the step: an exact skip, decided on the device
    assert _same(r["after"][t], r["before"][t])
    assert not _same(r["after"][SKIP], r["before"][SKIP])  # the late-skipped update landed
    assert not _same(r["after"][t + 1], r["before"][t + 1])  # the gate disarmed again
    gate = r["guard"].deferred
    assert gate.gate.gated == 1 and gate.late_skips == 1  # step SKIP + 1 was never asked for
    # without the skip_step the same batch is not the gate's business: its update lands
    free = _train(kind, set(), 1e3)
    assert not _same(free["after"][t], free["before"][t])
    assert free["guard"].deferred.gate.gated == 0
    # the gate off: it lands too
    off = _train(kind, {SKIP}, 1e3, gate=False)
    assert not _same(off["after"][t], off["before"][t])


@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw_fused"])
def test_a_healthy_batch_after_a_late_skip_trains_as_without_the_gate(kind: str) -> None:
    on, off = _train(kind, {SKIP}, 1.0), _train(kind, {SKIP}, 1.0, gate=False)
    assert on["guard"].deferred.gate.gated == 0
    for i in range(N):
        assert _same(on["after"][i], off["after"][i]), i


def test_a_nan_loss_after_a_late_skip_is_gated() -> None:
    r = _train("sgd_momentum", {SKIP}, math.nan)
    assert _same(r["after"][SKIP + 1], r["before"][SKIP + 1])
    assert all(bool(torch.isfinite(w).all()) for w in r["after"][N - 1])


def test_state_dict_round_trip_with_the_gated_step_pending() -> None:
    """A snapshot taken with the gated step not yet observed restores the gate's bookkeeping."""
    a = _train("sgd_momentum", {SKIP}, 1e3, snap_at=SKIP + 1)
    sd, model, opt_sd = a["snap"]
    assert sd["deferred"]["gate"]["armed"]["step"] == SKIP + 1
    assert len(sd["deferred"]["gate"]["losses"]) == SKIP + 1  # 0..SKIP: no alarm, "healthy"
    opt = _opt("sgd_momentum", model.parameters())
    opt.load_state_dict(opt_sd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    gb = TorchGuard(model, opt, sched, _Scripted({SKIP}), checkpoint_every=0, sync="deferred",
                    update_ratio_every=1)
    gb.load_state_dict(sd)
    for i in range(SKIP + 2, N):  # the rest of the run, as in a
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        gb.step(loss)
    gb.flush()
    assert _same(_state(model, opt), a["after"][N - 1])
    # the gated step observed after the restore: counted as gated, its skip carried out
    assert gb.deferred.state_dict() == a["guard"].deferred.state_dict()
    assert gb.deferred.gate.gated == 1 and gb.deferred.late_skips == 1
    bad = copy.deepcopy(sd)
    bad["deferred"]["gate"]["losses"][0] = "high"
    with pytest.raises(ValueError, match="deferred.gate.losses"):
        gb.load_state_dict(bad)


def test_gate_factor_is_checked() -> None:
    with pytest.raises(ValueError, match="'factor' parameter of SkipGate"):
        SkipGate(0.0)
    assert SkipGate(None).threshold() is None


def _spied(sync: str, steps: int, seed: int, fault: FaultSpec | None,
           gate: bool = True) -> tuple[Any, list[SkipGate]]:
    """A tinytrain MLP run with ``Monitor("small")``; the deferred guard's gates are kept."""
    made: list[SkipGate] = []

    def spy(*a: Any) -> SkipGate:
        made.append(SkipGate(*a) if gate else SkipGate(None))
        return made[-1]

    orig = deferred_mod.SkipGate
    deferred_mod.SkipGate = spy  # type: ignore[assignment,misc]
    try:
        r = train_run("mlp", steps, seed=seed, fault=fault, monitor=Monitor("small"),
                      guard_kwargs=None if sync == "step" else {"sync": sync})
    finally:
        deferred_mod.SkipGate = orig  # type: ignore[misc]
    return r, made


@pytest.fixture(scope="module")
def perm_runs() -> dict[str, Any]:
    """The benchmark's ``data_corrupt_perm`` run of the MLP (seed 0): garbage from step 161,
    in step mode, in deferred mode and in deferred mode without the gate."""
    fault = FaultSpec("data_corruption", 161, 0)
    (step, _), (late, gates), (off, _) = (
        _spied("step", 300, 0, fault), _spied("deferred", 300, 0, fault),
        _spied("deferred", 300, 0, fault, gate=False))
    return {"clean": train_run("mlp", 300, seed=0), "step": step, "late": late, "gates": gates,
            "off": off}


def test_persistent_data_corruption_gets_the_decisions_of_step_mode(
        perm_runs: dict[str, Any]) -> None:
    step, late, gates, off = (perm_runs[k] for k in ("step", "late", "gates", "off"))
    clean = perm_runs["clean"]
    assert step.rollbacks >= 1  # the garbage is skipped, adapted to, then rolled back
    # deferred: the same responses at the same steps, the same end
    assert [(i.step, i.type) for i in late.acting_interventions()] == \
        [(i.step, i.type) for i in step.acting_interventions()]
    assert late.stopped == step.stopped and late.rollbacks == step.rollbacks
    assert late.final_loss == pytest.approx(step.final_loss, rel=1e-6)
    assert len(gates) == 1 and gates[0].gated >= 7  # the garbage after the first skip
    # without the gate the skips land, the model fits the garbage and nothing stops it
    assert off.stopped is None and off.final_loss > 1.3 * clean.final_loss


@pytest.mark.xfail(strict=True, reason="open (issue 24), the same in step and deferred mode: "
                   "after the aftermath's rollback (step 244 -> 150) the garbage comes back; "
                   "the model fits it and its training loss falls (log level 5.5 -> 1.0 by "
                   "the end), which the probation's gap watch reads as closing the gap "
                   "(invariant 3: a run adapting to a shifted input window looks the same), "
                   "and the run ends (replayed step 236) before the validation's overfitting "
                   "stop can judge; final 2.24 vs clean 1.33 "
                   "(tests/adapters/test_rescue_mechanisms.py: 400 steps, stopped)")
def test_persistent_data_corruption_is_stopped_with_the_healthy_weights(
        perm_runs: dict[str, Any]) -> None:
    step, late = perm_runs["step"], perm_runs["late"]
    clean = perm_runs["clean"]
    # skips the garbage, adapts, rolls back and stops with the healthy weights
    for r in (step, late):
        assert r.stopped is not None and r.rollbacks >= 1
        assert r.final_loss < 1.05 * clean.final_loss


def test_clean_run_is_untouched() -> None:
    step, _ = _spied("step", 160, 1, None)
    late, gates = _spied("deferred", 160, 1, None)
    assert len(gates) == 1 and gates[0].gated == 0 and not late.acting_interventions()
    assert late.losses == step.losses and late.final_loss == step.final_loss


def _rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    with gloo.process_group(rank, world, port):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = TorchGuard(model, opt, None, _Scripted({SKIP}), checkpoint_every=0,
                           sync="deferred", log_interventions=False)
        moved = []
        for i in range(N):
            g = torch.Generator().manual_seed(1000 * rank + i)
            x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if rank == 1 and i == SKIP + 1:
                loss = loss * 1e3  # only rank 1 sees the bad batch
            loss.backward()
            gloo.average_gradients(model, world)
            w0 = [p.detach().clone() for p in model.parameters()]
            guard.step(loss)
            moved.append(not all(torch.equal(p, w) for p, w in zip(model.parameters(), w0,
                                                                  strict=True)))
        guard.flush()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"moved": moved, "gated": guard.deferred.gate.gated,
                       "w": [p.detach().flatten().tolist() for p in model.parameters()]}, fh)
    os._exit(0)  # (see tests/adapters/test_distributed.py: torch's gloo teardown)


def test_every_rank_skips_when_one_rank_sees_the_bad_batch(tmp_path: Any) -> None:
    r0, r1 = gloo.run_ranks(_rank_worker, 2, tmp_path)
    # the flag is reduced on the device: rank 0 (a healthy loss) skips the step with rank 1
    assert r0["moved"] == r1["moved"] == [True] * (SKIP + 1) + [False] + [True] * (N - SKIP - 2)
    assert r0["w"] == r1["w"]
    assert (r0["gated"], r1["gated"]) == (0, 1)  # each rank's own view of its loss


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw_fused", "adamw_foreach"])
def test_the_gate_skips_on_the_gpu_without_a_host_sync(kind: str) -> None:
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).to("cuda")
    opt = _opt(kind, model.parameters())
    guard = TorchGuard(model, opt, None, _Scripted({SKIP}), checkpoint_every=0, sync="deferred",
                       log_interventions=False)
    syncs, skipped = [], None
    for i in range(N):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        (loss * (1e3 if i == SKIP + 1 else 1.0)).backward()
        w0 = [t for t in _state(model, opt) if t.is_cuda]  # (Adam's CPU step count advances)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                guard.step(loss * (1e3 if i == SKIP + 1 else 1.0))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(m.message) for m in w))
        if i == SKIP + 1:
            skipped = _same([t for t in _state(model, opt) if t.is_cuda], w0)
    guard.flush()
    assert skipped and guard.deferred.gate.gated == 1
    assert max(syncs[3:]) == 0
