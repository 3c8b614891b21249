"""``sync="auto"`` (the default): resolution, state across modes, trainers (real torch, CPU)."""

from __future__ import annotations

import copy
import json
import logging
import os
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability.adapters.guard import sync_mode  # noqa: E402
from stability.adapters.guard.sync_mode import auto_sync, device_skips  # noqa: E402
from stability.adapters.interventions import TrainingStopped  # noqa: E402
from stability.adapters.torch import TorchGuard, attach  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Control  # noqa: E402
from tests.adapters.test_guard_deferred import _batch, _mlp, _run  # noqa: E402

from . import gloo  # noqa: E402
from .scripted import ScriptedMonitor, watch  # noqa: E402

torch.set_num_threads(1)


def _train(guard: TorchGuard, m: torch.nn.Module, batches: range) -> list[dict[str, Any]]:
    out = []
    for i in batches:
        x, y = _batch(i)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        out.append(guard.step(None).to_dict())
    return out


def _setup(mon: Any, sync: str, **kw: Any) -> tuple[TorchGuard, torch.nn.Module]:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return TorchGuard(model, opt, None, mon, checkpoint_every=0, sync=sync,
                      log_interventions=False, update_ratio_every=1, **kw), model


# ---------------------------------------------------------------------- resolution
def _param(device: str) -> Any:
    return SimpleNamespace(device=torch.device(device))


def _opt(params: list[Any], fused: bool) -> Any:
    opt = SimpleNamespace(param_groups=[{"params": params}])
    if fused:
        opt._step_supports_amp_scaling = True
    return opt


@pytest.mark.parametrize(("devices", "fused", "expected"), [
    (["cuda"], True, "deferred"),
    (["cuda", "cuda:1"], True, "deferred"),
    (["cuda"], False, "step"),
    (["cpu"], True, "step"),
    (["cuda", "cpu"], True, "step"),  # partly offloaded
    (["meta"], True, "step"),
    (["mps"], True, "step"),  # the deferred copy is non-blocking on CUDA only
    ([], True, "step"),
])
def test_auto_sync_predicate(devices: list[str], fused: bool, expected: str) -> None:
    params = [_param(d) for d in devices]
    mode, why = auto_sync(params[:1], _opt(params, fused))
    assert mode == expected and why
    if expected == "step" and devices == ["cuda"]:
        assert "not fused" in why


def test_device_skips_on_real_optimizers() -> None:
    w = [torch.nn.Parameter(torch.zeros(3))]
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        assert device_skips(cls(w, lr=0.1, fused=True))
        assert not device_skips(cls(w, lr=0.1))
    assert not device_skips(torch.optim.RMSprop(w, lr=0.1))
    meta = [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    assert auto_sync(meta, torch.optim.SGD(meta, lr=0.1))[0] == "step"
    # a real fused optimizer on the CPU: the device decides
    assert auto_sync(w, torch.optim.AdamW(w, lr=0.1, fused=True)) == ("step", "parameters on cpu")


def test_auto_is_the_default_and_resolves_to_step_on_the_cpu(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    guard = attach(model, opt, None, Monitor("small"), checkpoint_every=0)
    assert guard.sync_requested == guard.sync_mode == "auto" and guard.deferred is None
    assert guard.state_dict()["sync"] == "auto"
    with caplog.at_level(logging.INFO, logger="stability.adapters"):
        _train(guard, model, range(3))
    assert guard.sync_mode == "step" and guard.sync_requested == "auto"
    assert guard.deferred is None and guard.state_dict()["sync"] == "step"
    said = [r.getMessage() for r in caplog.records if "resolved" in r.getMessage()]
    assert said == ["stability: sync='auto' resolved to 'step' (parameters on cpu)"]
    with pytest.raises(ValueError, match=r"must be one of \('auto', 'step', 'deferred'\)"):
        TorchGuard(model, opt, sync="Auto")


def test_auto_on_the_cpu_is_the_step_mode_run_bit_for_bit() -> None:
    a, b = _run("step", n=30), _run("auto", n=30)
    assert b["guard"].sync_mode == "step"
    assert b["seen"] == a["seen"] and b["decisions"] == a["decisions"]
    assert b["ledger"] == a["ledger"] and b["rows"] == a["rows"]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))


def test_auto_resolves_at_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the predicate says at the first step counts (the parameters may be moved to their
    # device after the guard is built), and only then
    guard, model = _setup(Monitor("small"), "auto")
    monkeypatch.setattr(sync_mode, "auto_sync", lambda p, o: ("deferred", "test"))
    assert guard.sync_mode == "auto"
    _train(guard, model, range(2))
    assert guard.sync_mode == "deferred" and guard.deferred.pending.step == 1
    monkeypatch.setattr(sync_mode, "auto_sync", lambda p, o: ("step", "test"))
    _train(guard, model, range(2, 3))
    assert guard.sync_mode == "deferred" and guard.deferred.pending.step == 2


def test_an_undecidable_optimizer_takes_the_step_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(params: Any, opt: Any) -> tuple[str, str]:
        raise RuntimeError("param_groups unreadable")

    guard, model = _setup(ScriptedMonitor(once=False), "auto")
    monkeypatch.setattr(sync_mode, "auto_sync", broken)
    _train(guard, model, range(2))
    assert guard.sync_mode == "step" and guard.monitor.seen == [0, 1]


def test_auto_resolved_to_deferred_is_the_deferred_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _run("deferred", n=30)
    monkeypatch.setattr(sync_mode, "auto_sync", lambda p, o: ("deferred", "test"))
    b = _run("auto", n=30)
    g = b["guard"]
    assert g.sync_mode == "deferred" and g.sync_requested == "auto" and g.deferred is not None
    assert b["seen"] == a["seen"] and b["decisions"] == a["decisions"]
    assert b["ledger"] == a["ledger"]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    assert g.state_dict()["sync"] == "deferred"


# ---------------------------------------------------------------------- state across modes
@pytest.mark.parametrize("into", ["step", "auto"])
def test_a_pending_step_restored_into_a_step_mode_guard_is_observed_once(into: str) -> None:
    mon_a = Monitor("small")
    seen_a = watch(mon_a)
    ga, model = _setup(mon_a, "deferred")
    _train(ga, model, range(8))
    sd = json.loads(json.dumps(ga.state_dict()))
    assert sd["sync"] == "deferred" and sd["deferred"]["pending"]["step"] == 7
    m2 = copy.deepcopy(model)
    o2 = torch.optim.AdamW(m2.parameters(), lr=3e-3)
    o2.load_state_dict(copy.deepcopy(ga.optimizer.state_dict()))
    mon_b = Monitor("small")
    seen_b = watch(mon_b)
    gb = TorchGuard(m2, o2, None, mon_b, checkpoint_every=0, sync=into,
                    log_interventions=False, update_ratio_every=1)
    gb.load_state_dict(sd)
    if into == "auto":  # not resolved yet: the restored pending step is kept, and given back
        assert gb.sync_mode == "auto" and gb.state_dict()["deferred"] == sd["deferred"]
    d8 = _train(gb, m2, range(8, 9))[0]
    assert d8["step"] == 7  # the first step observes the pending step (the deferred way) ...
    assert [s for s, _, _ in seen_b] == [7, 8]  # ... and its own signals at its end
    assert gb.sync_mode == "step" and gb.deferred is None
    ga.flush()
    assert seen_b[0] == seen_a[7]  # the snapshot's signals
    for t in range(9, 12):  # then step mode: step t observed during step t
        assert _train(gb, m2, range(t, t + 1))[0]["step"] == t
    assert [s for s, _, _ in seen_b] == list(range(7, 12))
    assert gb.flush() is None and "deferred" not in gb.state_dict()


def test_the_handover_step_takes_a_step_mode_callers_signals() -> None:
    ga, model = _setup(ScriptedMonitor(once=False), "deferred")
    _train(ga, model, range(4))
    sd = json.loads(json.dumps(ga.state_dict()))
    mon = ScriptedMonitor(once=False)
    gb, m2 = _setup(mon, "step")
    gb.load_state_dict(sd)
    for i in (4, 5):  # the low-level step-mode loop: collect() + check(signals=...)
        x, y = _batch(i)
        loss = torch.nn.functional.cross_entropy(m2(x), y)
        loss.backward()
        gb.check(loss, signals=gb.collect(loss))
        if gb.should_step:
            gb.optimizer.step()
        gb.optimizer.zero_grad(set_to_none=True)
        gb.finish()
    assert mon.seen == [3, 4, 5] and gb.deferred is None and gb.step_count == 6


def test_a_late_stop_restored_into_a_step_mode_guard_is_carried_out() -> None:
    late = {5: Control(stop=True, stop_reason="late")}
    ga, model = _setup(ScriptedMonitor(late, once=False), "deferred")
    _train(ga, model, range(6))  # step 5 pending: its stop not seen yet
    sd = json.loads(json.dumps(ga.state_dict()))
    mon = ScriptedMonitor(late, once=False)
    gb, m2 = _setup(mon, "step")
    gb.load_state_dict(sd)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(TrainingStopped, match="late") as err:
        _train(gb, m2, range(6, 7))
    assert err.value.step == 5 and mon.seen == [5] and gb.deferred is None
    assert all(torch.equal(p, q) for p, q in zip(m2.parameters(), before, strict=True))


def test_a_step_mode_snapshot_restored_into_a_deferred_guard() -> None:
    script = {s: Control(lr_factor=0.5) for s in range(4, 20)}
    ga, model = _setup(ScriptedMonitor(script, once=False), "step")
    _train(ga, model, range(8))
    sd = json.loads(json.dumps(ga.state_dict()))
    assert sd["sync"] == "step" and "deferred" not in sd
    assert sd["control"]["lr_factor"] == 0.5
    mon = ScriptedMonitor(script, once=False)
    gb, m2 = _setup(mon, "deferred")
    gb.load_state_dict(sd)
    assert gb.deferred is not None and gb.deferred.pending is None
    x, y = _batch(8)
    torch.nn.functional.cross_entropy(m2(x), y).backward()
    assert gb.check(None).step == -1  # nothing pending: nothing to observe
    assert gb.multiplier.factor == 0.5  # the LR cut in force governs the first update
    gb.optimizer.step()
    gb.optimizer.zero_grad(set_to_none=True)
    gb.finish()
    _train(gb, m2, range(9, 12))
    gb.flush()
    assert mon.seen == list(range(8, 12))


def test_a_round_trip_between_modes_and_bad_fields() -> None:
    ga, model = _setup(ScriptedMonitor(once=False), "deferred")
    _train(ga, model, range(3))
    sd = json.loads(json.dumps(ga.state_dict()))
    gb, _ = _setup(ScriptedMonitor(once=False), "auto")
    gb.load_state_dict(sd)
    assert gb.state_dict()["deferred"] == sd["deferred"]  # unresolved: kept as it came
    bad = copy.deepcopy(sd)
    bad["sync"] = "later"
    with pytest.raises(ValueError, match="'sync'"):
        gb.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["deferred"]["pending"]["scalars"]["loss"] = "low"
    for sync in ("step", "auto"):  # every mode checks the pending step before anything changes
        gc, _ = _setup(ScriptedMonitor(once=False), sync)
        with pytest.raises(ValueError, match="deferred.pending.scalars.loss"):
            gc.load_state_dict(bad)
        assert gc.step_count == 0 and gc.deferred is None
    step_sd = _setup(ScriptedMonitor(once=False), "step")[0].state_dict()
    step_sd["control"]["lr_factor"] = 0.0
    with pytest.raises(ValueError, match="lr_factor"):
        _setup(ScriptedMonitor(once=False), "deferred")[0].load_state_dict(step_sd)


# ---------------------------------------------------------------------- distributed
def _rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo.process_group(rank, world, port):
        from stability.adapters.guard import sync_mode as sm
        from stability.adapters.torch import TorchGuard as Guard

        modes = []
        real = sm.auto_sync
        for forced in (None, "deferred" if rank == 0 else None, "deferred"):
            sm.auto_sync = real if forced is None else (lambda p, o: ("deferred", "forced"))
            torch.manual_seed(0)
            m = torch.nn.Linear(4, 1)
            guard = Guard(m, torch.optim.SGD(m.parameters(), lr=0.1), None, Monitor("small"),
                          checkpoint_every=0)
            for i in range(3):
                g = torch.Generator().manual_seed(100 * rank + i)
                m(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
                guard.step(None)
            guard.flush()
            modes.append([guard.sync_mode, guard.deferred is not None, guard.step_count])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(modes, fh)
    os._exit(0)  # (see test_distributed.py: torch's gloo teardown)


def test_ranks_resolve_the_same_mode(tmp_path: Any) -> None:
    r0, r1 = gloo.run_ranks(_rank_worker, 2, tmp_path)
    # CPU: step on both; one rank alone would take deferred: step on both; all: deferred
    assert r0 == r1 == [["step", False, 3], ["step", False, 3], ["deferred", True, 3]]
