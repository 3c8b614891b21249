"""``stability watch --ranks``: the culprit rank from per-rank logs written by 4 real processes
(NaN on one rank, a rank 5x slower, a gradient norm that departs, a stalled rank), and no
accusation on clean steps."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.cli import main
from replay.watch_ranks import LineParser, RankWatcher, split_rank
from stability.ranks.ranks import RankMonitor

WORLD = 4
STEPS = 90
PERIOD = 0.1  #: the job's step time on its own (logged) clock
T0 = 1.7e9
#: the faults: (first step, last step, rank, what)
FAULTS = [(15, 15, 2, "nan"), (25, 29, 1, "slow"), (35, 35, 3, "grad"), (45, STEPS, 0, "stall")]


def _line(rank: int, step: int, t: float, rng: Any, fmt: str, faults: bool) -> str:
    loss = 2.5 - 0.005 * step + rng.normal(0.0, 0.02)
    gn = float(np.exp(rng.normal(0.0, 0.05)))
    if faults and (step, rank) == (15, 2):
        loss = gn = math.nan
    if faults and (step, rank) == (35, 3):
        gn *= 10.0
    if fmt == "jsonl":
        return json.dumps({"step": step, "loss": loss, "grad_norm": gn, "time": t}) + "\n"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f",{int(t % 1 * 1000):03d}"
    return f"[rank{rank}]: {stamp} INFO step={step} loss={loss:.5f} grad_norm={gn:.5f}\n"


#: real seconds between steps of the fake job
TICK = 0.05


def _write_rank(path: str, rank: int, fmt: str, faults: bool, barrier: Any = None) -> None:
    """One rank of a fake job: a line per step, stamped with its own (logged) clock.  With a
    ``barrier`` the ranks start together and keep step in real time (``start + step * TICK``,
    as the collectives of a real job make them), so the watcher reads the logs as they grow."""
    rng = np.random.default_rng(rank)
    t = T0
    start = 0.0
    if barrier is not None:
        barrier.wait()
        start = time.time()
    with open(path, "a", encoding="utf-8") as fh:
        for step in range(STEPS):
            if faults and rank == 0 and step >= 45:
                return  # rank 0's log stops; the others go on
            slow = faults and rank == 1 and 25 <= step <= 29
            t += PERIOD * (5.0 if slow else 1.0) * float(np.exp(rng.normal(0.0, 0.03)))
            fh.write(_line(rank, step, t, rng, fmt, faults))
            fh.flush()
            if start:
                time.sleep(max(0.0, start + (step + 1) * TICK - time.time()))


def _run_job(paths: list[Path], fmt: str, faults: bool, w: RankWatcher) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WORLD)
    procs = [ctx.Process(target=_write_rank,
                         args=(str(paths[r % len(paths)]), r, fmt, faults, barrier))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        w.poll()
        time.sleep(0.05)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    w.run(once=True)


def _in_fault(a: Any) -> bool:
    rank = int(a.signal.split("/")[0][4:])
    return any(lo <= a.step <= hi + 1 and rank == (r if what != "stall" else 0)
               for lo, hi, r, what in FAULTS)


def test_four_rank_logs_name_the_faulty_rank(tmp_path: Path) -> None:
    paths = [tmp_path / f"rank{r}.jsonl" for r in range(WORLD)]
    ev = tmp_path / "events.jsonl"
    # live: rank 0's silence is measured on the watcher's clock (it stops 45 steps = 2.25 s
    # before the others)
    w = RankWatcher([str(p) for p in paths], hosts=["n0", "n0", "n1", "n1"], stall_after=1.0,
                    events=str(ev), echo=None)
    _run_job(paths, "jsonl", True, w)
    w.close()
    assert w.accused() == {2: ["nonfinite"], 1: ["step_time"], 3: ["grad_norm"], 0: ["stall"]}
    assert all(_in_fault(a) for a in w.alarms), [a.message for a in w.alarms if not _in_fault(a)]
    stall = next(a for a in w.alarms if a.kind == "rank_stall")
    assert stall.message.startswith("rank 0 / n0 stalled: no line for ")
    assert "last line at step 44; other ranks at step" in stall.message
    nan = next(a for a in w.alarms if a.signal == "rank2/nonfinite")
    assert nan.step == 15 and "rank 2 / n1" in nan.message
    assert w.steps_judged == STEPS
    kinds = [json.loads(x)["type"] for x in ev.read_text().splitlines()]
    assert kinds.count("alarm") == len(w.alarms) and "rank_health" in kinds


def test_clean_combined_torchrun_log_accuses_nobody(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    w = RankWatcher([str(log)], stall_after=1.0, echo=None)
    _run_job([log], "torchrun", False, w)
    assert w.world == WORLD and w.steps_judged == STEPS
    assert w.alarms == []


def test_wall_clock_stall_while_following_live(tmp_path: Path) -> None:
    """Without line times, silence is measured on the watcher's clock."""
    now = [0.0]
    paths = [tmp_path / f"r{r}.log" for r in range(3)]
    w = RankWatcher([str(p) for p in paths], stall_after=30.0, echo=None, clock=lambda: now[0])
    for step in range(7):
        for r, p in enumerate(paths):
            if r == 2 and step > 2:
                continue  # rank 2 stops after step 2
            with p.open("a") as fh:
                fh.write(f"step={step} loss=2.0 grad_norm=1.0\n")
        now[0] += 10.0
        w.poll()
    stalls = [a for a in w.alarms if a.kind == "rank_stall"]
    assert [a.signal for a in stalls] == ["rank2/stall"]
    assert "no line for 40.0 s (last line at step 2; other ranks at step 6)" in stalls[0].message
    with paths[2].open("a") as fh:  # it logs again: the episode ends, a new one may start
        fh.write("step=7 loss=2.0 grad_norm=1.0\n")
    w.poll()
    assert not w.ranks[2].stalled


def test_prefixes_and_line_formats() -> None:
    assert split_rank("[default1]: x=1") == (1, "x=1")
    assert split_rank("[1,3]<stdout>: step=2") == (3, "step=2")
    assert split_rank("no prefix") == (None, "no prefix")
    p = LineParser("r3")
    mega = (" iteration       10/     100 | consumed samples: 640 | elapsed time per iteration "
            "(ms): 250.0 | learning rate: 1.0E-04 | lm loss: 2.5E+00 | grad norm: 1.25 |")
    step, vals, when = p.parse(split_rank("[rank3]:" + mega)[1])  # type: ignore[misc]
    assert (step, vals["loss"], vals["grad_norm"], vals["step_time"], when) == (
        10, 2.5, 1.25, 0.25, None)
    ds = p.parse("steps: 20 loss: 2.1 iter time (s): 0.5 samples/sec: 64")
    assert ds is not None and ds[0] == 20 and ds[1]["loss"] == 2.1
    got = p.parse('{"global_step": 3, "train/loss": "nan", "timestamp": 1700000000500}')
    assert got is not None and got[0] == 3 and got[2] == 1700000000.5
    assert list(got[1]) == ["loss"] and math.isnan(got[1]["loss"])
    assert p.parse("loading checkpoint from step 4") is None


def test_absent_rank_is_not_a_nonfinite_rank() -> None:
    mon = RankMonitor(["a"] * 4)
    x = np.array([[2.0, 1.0, 0.1, 0.0, 0.0]] * 4)
    x[3] = np.nan  # rank 3 has not logged this step
    assert mon.observe(0, x, present=[True, True, True, False]) == ()
    assert [a.signal for a in mon.observe(1, x)] == ["rank3/nonfinite"]
    y = x.copy()
    y[1, 1] = 40.0
    alarms = mon.observe(2, y, present=[True, True, True, False])
    assert [a.signal for a in alarms] == ["rank1/grad_norm"]
    with pytest.raises(ValueError, match="one 'present' flag per rank"):
        mon.observe(3, x, present=[True])


def test_cli_watch_ranks_once_post_mortem(tmp_path: Path, capsys: Any) -> None:
    for r in range(WORLD):
        _write_rank(str(tmp_path / f"rank{r}.jsonl"), r, "jsonl", True)
    files = [str(tmp_path / f"rank{r}.jsonl") for r in range(WORLD)]
    assert main(["watch", "--ranks", *files, "--once", "--stall-after", "1",
                 "--hosts", "a,b,c,d"]) == 0
    out, err = capsys.readouterr()
    assert "step 15: non-finite loss or gradient on rank 2 / c only" in out
    assert "rank 0 / a stalled: no line for 4.5 s (last line at step 44; other ranks at " \
        "step 89)" in out  # post-mortem: 45 steps of 0.1 s on the other ranks' clocks
    assert "named rank 0: stall; rank 1: step_time; rank 2: nonfinite; rank 3: grad_norm" in err
