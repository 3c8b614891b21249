"""Gloo ranks on CPU with DDP: one rank injects a fault; the alarm names it on every rank.

One process group runs a seeded fault plan (a NaN loss, a 5x gradient scale standing in for a
bit flip, a 5x slowdown) with clean steps in between, so a single spawn covers every kind.
``run_fleet`` is also what ``benchmarks/bench_fleet.py`` drives with many more faults.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)

KINDS = ("nan", "scale", "slow")
#: the signal an injected fault of each kind is expected to be named by
EXPECTED_SIGNAL = {"nan": "nonfinite", "scale": "grad_norm", "slow": "step_time"}
SLOW_STEPS = 3  # a slow rank stays slow for a few steps; it is named from the 2nd one
WORK_S = 0.05  # simulated compute per step (a sleep: real steps are longer than OS jitter)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_plan(seed: int, world: int, n_faults: int, first: int = 12, gap: int = 8,
              kinds: tuple[str, ...] = KINDS) -> list[tuple[int, str, int]]:
    """``(step, kind, rank)`` faults at seeded steps, ``gap`` apart or more (clean in between)."""
    rng = random.Random(seed)
    plan, step = [], first
    for i in range(n_faults):
        step += rng.randrange(0, 4)
        plan.append((step, kinds[i % len(kinds)], rng.randrange(world)))
        step += gap
    return plan


def _collective_cost(iters: int) -> dict[str, float]:
    """Median microseconds of back-to-back ``reduce`` calls: with the gather, and without."""
    from stability.adapters.distributed import ControlSync
    from stability.types import Control

    syncs = {"all_reduce": ControlSync(), "gather": ControlSync(ranks=True)}
    ts: dict[str, list[float]] = {name: [] for name in syncs}
    for i in range(iters):  # interleaved, so that load drifts hit both alike
        for name, sync in syncs.items():
            dist.barrier()
            t0 = time.perf_counter()
            sync.reduce(Control(), i, False, loss=1.0, grad_norm=1.0, step_time=0.1)
            ts[name].append(time.perf_counter() - t0)
    return {name: 1e6 * sorted(t)[len(t) // 2] for name, t in ts.items()}


def _worker(rank: int, world: int, port: int, out_dir: str, plan: list[Any], n_steps: int,
            gather: bool, overhead_iters: int = 0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from stability.adapters.distributed import ControlSync, register_local_grad_norm_hook
        from stability.types import Control

        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 1)))
        signals = register_local_grad_norm_hook(model)
        sync = ControlSync(ranks=gather, signals=signals)
        opt = torch.optim.SGD(model.parameters(), lr=0.005)
        faults = {}
        for step, kind, who in plan:
            for k in range(SLOW_STEPS if kind == "slow" else 1):
                faults[step + k] = (kind, who)
        log, reduce_s = [], []
        for i in range(n_steps):
            kind, who = faults.get(i, ("", -1))
            mine = who == rank
            time.sleep(WORK_S * (5.0 if mine and kind == "slow" else 1.0))
            g = torch.Generator().manual_seed(7919 * rank + i)
            x = torch.randn(4096, 8, generator=g)
            y = torch.sin(2.0 * x[:, :1]) + x[:, 1:2] * x[:, 2:3]
            loss = torch.nn.functional.mse_loss(model(x), y)
            if mine and kind == "nan":
                loss = loss * float("nan")
            (loss * 5.0 if mine and kind == "scale" else loss).backward()
            t0 = time.perf_counter()
            if gather:
                control, alarmed = sync.reduce(Control(), i, False, loss=loss.detach())
            else:
                control, alarmed = sync.reduce(Control(), i, False)
            reduce_s.append(time.perf_counter() - t0)
            if not control.skip_step:
                opt.step()
            opt.zero_grad(set_to_none=True)
            log.append([i, [a.signal for a in sync.rank_alarms], control.skip_step, alarmed,
                        [a.message for a in sync.rank_alarms],
                        [row[12:] for row in sync.gathered]])
        ledger = sync.ranks.records(n_steps) if sync.ranks is not None else []
        overhead = _collective_cost(overhead_iters) if overhead_iters else {}
        path = os.path.join(out_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump({"log": log, "ledger": ledger, "hosts": sync.hosts,
                       "reduce_s": reduce_s, "overhead_us": overhead,
                       "w": [p.detach().sum().item() for p in model.parameters()]}, fh)
        os.replace(path + ".tmp", path)
        dist.barrier()
        del model, opt  # the DDP reducer (and its hook) before the process group
        gc.collect()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip C++ static destructors: torch's gloo teardown can abort at exit


def run_fleet(out_dir: str, world: int, plan: list[tuple[int, str, int]], n_steps: int,
              gather: bool = True, timeout: float = 300.0,
              overhead_iters: int = 0) -> list[dict[str, Any]]:
    """Spawn ``world`` gloo ranks running ``plan``; return each rank's JSON result."""
    ctx = torch.multiprocessing.start_processes(
        _worker, args=(world, _free_port(), out_dir, plan, n_steps, gather, overhead_iters),
        nprocs=world,
        join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    paths = [os.path.join(out_dir, f"rank{r}.json") for r in range(world)]
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError("distributed run timed out")
    except torch.multiprocessing.ProcessExitedException:
        # gloo can abort a process at interpreter exit (pytorch#179291); the results written
        # before the final barrier are complete -- anything earlier is a real failure
        if not all(os.path.exists(p) for p in paths):
            raise
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as fh:
            out.append(json.load(fh))
    return out


WORLD = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any], int]:
    plan = make_plan(seed=15, world=WORLD, n_faults=3)
    n_steps = plan[-1][0] + SLOW_STEPS + 4
    res = run_fleet(str(tmp_path_factory.mktemp("fleet")), WORLD, plan, n_steps)
    return res, plan, n_steps


def test_every_rank_takes_the_same_decisions(fleet: Any) -> None:
    res, _, _ = fleet
    for r in res[1:]:
        assert r["log"] == res[0]["log"]
        assert r["ledger"] == res[0]["ledger"]
        assert r["w"] == pytest.approx(res[0]["w"])  # replicas stayed identical
    assert len(res[0]["hosts"]) == WORLD


def test_alarm_names_the_faulty_rank(fleet: Any) -> None:
    res, plan, _ = fleet
    log = {row[0]: row for row in res[0]["log"]}
    for step, kind, who in plan:
        at = step + 1 if kind == "slow" else step  # one slow step is jitter; two: a straggler
        named = log[at][1]
        assert named == [f"rank{who}/{EXPECTED_SIGNAL[kind]}"], (step, kind, who, log[at])
        assert f"on rank {who} / " in log[at][4][0]
        assert log[at][3]  # the step is unhealthy on every rank
        assert log[at][2] == (kind in ("nan", "scale"))  # a corrupted average is not applied


def test_clean_steps_accuse_no_rank(fleet: Any) -> None:
    res, plan, _ = fleet
    faulty = {step + k for step, kind, _ in plan
              for k in range(SLOW_STEPS if kind == "slow" else 1)}
    wrong = [row for row in res[0]["log"] if row[1] and row[0] not in faulty]
    assert wrong == []
    # slow steps after the first may be named too, but only the slow rank
    for step, kind, who in plan:
        if kind == "slow":
            for k in range(SLOW_STEPS):
                row = res[0]["log"][step + k]
                assert all(s.startswith(f"rank{who}/") for s in row[1]), row


def test_ledger_exports_rank_health_records(fleet: Any) -> None:
    from stability.ranks.ranks import format_ranks

    res, plan, _ = fleet
    recs = res[0]["ledger"]
    assert {r["rank"] for r in recs} == {who for _, _, who in plan}
    assert all(r["type"] == "rank_health" and r["outlier_steps"] >= 1 for r in recs)
    text = format_ranks(recs)
    for _, _, who in plan:
        assert f"\n{who:>4}  " in "\n" + text.split("\n", 1)[1]


def test_without_process_group_nothing_is_gathered() -> None:
    from stability.adapters.distributed import ControlSync, RankSignals
    from stability.types import Control

    sig = RankSignals()
    sync = ControlSync(ranks=True, signals=sig)
    c = Control(skip_step=True)
    out, alarmed = sync.reduce(c, 3, False, loss=torch.tensor(float("nan")))
    assert out is c and not alarmed and sync.rank_alarms == () and sync.ranks is None
    row = sig.vector(loss=torch.tensor(2.0), grad_norm=3.0, step_time=0.5, data_wait=0.25)
    assert [float(v) for v in row] == [2.0, 3.0, 0.5, 0.25, 0.0]


def _guard_worker(rank: int, world: int, port: int, out_dir: str, bad_step: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from stability.adapters.distributed import ControlSync, register_local_grad_norm_hook
        from stability.adapters.torch import TorchGuard
        from stability.monitor.monitor import Monitor

        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                        torch.nn.Linear(32, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.005)
        sync = ControlSync(ranks=True, signals=register_local_grad_norm_hook(model))
        guard = TorchGuard(model, opt, None, Monitor("small"), distributed=sync,
                           checkpoint_every=0, log_interventions=False)
        log = []
        for i in guard.batches(bad_step + 4):
            g = torch.Generator().manual_seed(7919 * rank + i)
            x = torch.randn(4096, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(2.0 * x[:, :1]))
            (loss * 5.0 if rank == world - 1 and i == bad_step else loss).backward()
            guard.step(loss)
            log.append([i, [a.signal for a in sync.rank_alarms], guard.should_step,
                        guard.healthy])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"log": log}, fh)
        dist.barrier()
        del model, opt, guard
        gc.collect()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip C++ static destructors: torch's gloo teardown can abort at exit


def test_torch_guard_with_rank_sync_names_the_rank(tmp_path: Any) -> None:
    world, bad = 3, 12  # 3 ranks: the smallest world where an outlier can be named
    ctx = torch.multiprocessing.start_processes(
        _guard_worker, args=(world, _free_port(), str(tmp_path), bad), nprocs=world,
        join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail("distributed test timed out")
    except torch.multiprocessing.ProcessExitedException:
        if not all((tmp_path / f"rank{r}.json").exists() for r in range(world)):
            raise
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text())["log"] for r in range(world)]
    assert logs[1] == logs[0] and logs[2] == logs[0]
    named = [(row[0], row[1]) for row in logs[0] if row[1]]
    assert named == [(bad, [f"rank{world - 1}/grad_norm"])]
    row = logs[0][bad]
    assert row[2] is False and row[3] is False  # skipped and unhealthy on every rank
