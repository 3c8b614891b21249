"""Crash and resume: SIGKILL a training child at seeded points, resume from the last checkpoint.

For every kill point ``(step, phase)`` (see ``_crashchild``):

* the killed run's Parquet directory is readable and holds every step up to the last closed part
  (at most the last ``PART_STEPS`` logged steps are missing), with values identical to the
  uninterrupted run's;
* its event log is readable (at most a torn last record);
* after a restart from the last checkpoint with the saved monitor state, every decision (alarms,
  interventions, control, and the loss itself) is bit-identical to the uninterrupted run;
* after the resumed run finishes, the recorded run equals the uninterrupted run except for the
  rows that were still buffered at the kill *and* precede the checkpoint (at most one part; a loop
  that flushes the recorder when it checkpoints loses none), and the event log reads cleanly
  (``errors="raise"``) and holds the uninterrupted run's events.

The children are forked from the (already warm) test process, so a kill point costs ~0.5 s
instead of a fresh interpreter's import time.  20 kill points by default, 60 with the long flag.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.reader import read_run
from stability.outputs.events import read_events

from . import _crashchild as child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

CHILD_TIMEOUT = 120.0


def _run_child(workdir: Path, kill_step: int = -1, phase: str = "", resume: bool = False) -> int:
    ctx = mp.get_context("fork")
    p = ctx.Process(target=child.train, args=(str(workdir), kill_step, phase, resume))
    p.start()
    p.join(CHILD_TIMEOUT)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError(f"training child hung (kill point {kill_step}/{phase})")
    assert p.exitcode is not None
    return p.exitcode


def _decisions(path: Path) -> tuple[list[str], list[str]]:
    """(lines before the resume marker, lines after it), marker excluded."""
    raw = [ln for ln in path.read_text().splitlines() if ln]
    for i, ln in enumerate(raw):
        if ln.startswith('{"resume_from"'):
            return raw[:i], raw[i + 1:]
    return raw, []


def _step_of(line: str) -> int:
    return int(json.loads(line)["step"])


def _assert_same(got: Any, ref: Any) -> None:
    """Same columns, same values bit for bit (NaN == NaN, unlike ``Table.equals``)."""
    assert got.column_names == ref.column_names and got.num_rows == ref.num_rows
    for name in got.column_names:
        a = got.column(name).to_numpy(zero_copy_only=False)
        b = ref.column(name).to_numpy(zero_copy_only=False)
        np.testing.assert_array_equal(a, b, err_msg=f"column {name!r}")


def _strip_time(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "time"} for r in recs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch = pytest.importorskip("torch")

    wd = tmp_path_factory.mktemp("crash-ref")
    threads = torch.get_num_threads()
    try:  # in-process: also warms torch / numba / pyarrow once for all the forked children
        child.train(str(wd))
    finally:
        torch.set_num_threads(threads)
    lines, _ = _decisions(wd / "decisions.jsonl")
    table = read_run(wd / "run")
    events = _strip_time(read_events(wd / "events.jsonl"))
    assert len(lines) == child.N_STEPS
    assert any(json.loads(ln)["interventions"] for ln in lines), "reference run never intervened"
    return {"lines": lines, "table": table, "events": events}


def kill_points(n: int, seed: int = 20240607) -> list[tuple[int, str]]:
    rng = np.random.default_rng(seed)
    pts = []
    for i in range(n):
        phase = child.PHASES[i % len(child.PHASES)]
        if phase == "ckpt_write":
            step = int(rng.integers(1, child.N_STEPS // child.CKPT_EVERY)) * child.CKPT_EVERY
        else:
            step = int(rng.integers(0, child.N_STEPS - 1))
        pts.append((step, phase))
    # the interesting moments: on an alarm step, on the NaN step, right after a checkpoint
    pts[: 3] = [(60, "after_observe"), (150, "after_observe"), (131, "before_observe")]
    return pts


def _check_crash_point(tmp: Path, ref: dict[str, Any], kill_step: int, phase: str) -> None:
    wd = tmp / f"k{kill_step}-{phase}"
    while wd.exists():  # the same kill point drawn twice
        wd = wd.with_name(wd.name + "+")
    code = _run_child(wd, kill_step, phase)
    assert code == -signal.SIGKILL, f"child exit code {code} (expected SIGKILL)"

    # 1. the crashed run's record is readable; at most the last unflushed part is missing
    ref_tab = ref["table"]
    if any((wd / "run").glob("part-*.parquet")):
        got = read_run(wd / "run")
        n = got.num_rows
        _assert_same(got, ref_tab.slice(0, n))
    else:
        n = 0
    before, _ = _decisions(wd / "decisions.jsonl")
    last = _step_of(before[-1]) if before else -1
    # steps given to the recorder before the kill (it logs a step just before observe())
    logged = last + (2 if phase == "before_observe" else 1)
    assert 0 <= logged - n <= child.PART_STEPS, f"{logged - n} logged steps lost (> one part)"

    # 2. the crashed run's event log is readable (a torn last record is skipped)
    crashed_events = _strip_time(read_events(wd / "events.jsonl"))
    assert crashed_events == ref["events"][: len(crashed_events)]

    # 3. resume: decisions from the checkpoint on are bit-identical
    code = _run_child(wd, resume=True)
    assert code == 0, f"resumed child exit code {code}"
    before, after = _decisions(wd / "decisions.jsonl")
    assert before == ref["lines"][: len(before)]
    first = _step_of(after[0])
    assert first <= last + 1 and (first % child.CKPT_EVERY == 1 or first == 0)
    assert after == ref["lines"][first:], "decisions after resume differ from the uninterrupted run"

    # 4. the final record equals the uninterrupted run's; the event log reads cleanly
    final = read_run(wd / "run")
    steps = final.column("step").to_numpy()
    missing = sorted(set(range(child.N_STEPS)) - set(steps.tolist()))
    # rows buffered at the kill and older than the checkpoint are gone for good (<= one part)
    assert len(missing) <= child.PART_STEPS and all(n <= m < first for m in missing), missing
    keep = np.isin(ref_tab.column("step").to_numpy(), steps)
    _assert_same(final, ref_tab.filter(keep))
    events = read_events(wd / "events.jsonl", errors="raise")
    marks = [i for i, e in enumerate(events) if e.get("message") == "resumed"]
    assert len(marks) == 1
    resumed = _strip_time(events[marks[0] + 1:])
    assert resumed == [e for e in ref["events"] if e["step"] >= first]
    assert _strip_time(events[: marks[0]]) == ref["events"][: marks[0]]


@pytest.mark.parametrize("point", kill_points(20), ids=lambda p: f"{p[0]}-{p[1]}")
def test_kill_and_resume(tmp_path: Path, reference: dict[str, Any],
                         point: tuple[int, str]) -> None:
    _check_crash_point(tmp_path, reference, *point)


@pytest.mark.slow
def test_kill_and_resume_long(tmp_path: Path, reference: dict[str, Any]) -> None:
    for point in kill_points(60, seed=7):
        _check_crash_point(tmp_path, reference, *point)
