"""RunRecorder integrity: several writers, bad input, read-only and full disks, stale files.

Every test reads the directory back with :func:`replay.reader.read_run` and checks the rows that
must be there, so "no exception" alone never passes.
"""

from __future__ import annotations

import errno
import logging
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replay.recorder as recorder_mod
from replay.reader import read_run
from replay.recorder import RunRecorder, part_name

FORK = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
LOCKS = pytest.mark.skipif(recorder_mod.fcntl is None, reason="needs fcntl.flock")


def _parts(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.startswith("part-"))


def _hidden(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.startswith("."))


def _column(d: Path, name: str) -> list[Any]:
    return read_run(d, default_aliases=False).column(name).to_pylist()


# ---------------------------------------------------------------------------- several writers
def test_two_writers_interleaved_never_overwrite(tmp_path: Path) -> None:
    """Both open before either writes: both start at part 0, so every part name collides."""
    n = 200
    a = RunRecorder(tmp_path, part_steps=7)
    b = RunRecorder(tmp_path, part_steps=7)
    assert b.other_writers == 1 and a.writer_id != b.writer_id
    assert a.locked and b.locked
    for s in range(n):
        a.log(s, {"a": float(s), "loss": float(s)} if s % 2 == 0 else {"a": float(s)})
        b.log(s, {"b": -float(s), "loss": float(s)} if s % 2 == 1 else {"b": -float(s)})
    a.close()
    b.close()
    assert len(_parts(tmp_path)) == a.parts_written + b.parts_written == 2 * math.ceil(n / 7)
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t["step"] == list(range(n))
    assert t["a"] == [float(s) for s in range(n)]
    assert t["b"] == [-float(s) for s in range(n)]
    assert t["loss"] == [float(s) for s in range(n)]  # one metric, two writers, disjoint steps
    assert _hidden(tmp_path) == []  # both writer locks released


def test_writers_without_hard_links_use_the_directory_lock(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(recorder_mod.os, "link", no_link)
    a = RunRecorder(tmp_path, part_steps=5)
    b = RunRecorder(tmp_path, part_steps=5)
    for s in range(50):
        a.log(s, {"a": 1.0})
        b.log(s, {"b": 2.0})
    a.close()
    b.close()
    assert len(_parts(tmp_path)) == 20
    assert _column(tmp_path, "a") == [1.0] * 50 and _column(tmp_path, "b") == [2.0] * 50


def _write_rows(directory: str, metric: str, n: int, part_steps: int, step0: int = 0,
                stride: int = 1, barrier: Any = None) -> None:
    rec = RunRecorder(directory, part_steps=part_steps)
    if barrier is not None:
        barrier.wait(30)
    for i in range(n):
        s = step0 + i * stride
        rec.log(s, {metric: float(s), "shared": float(s)})
    rec.close()


def test_two_writer_threads_keep_all_rows(tmp_path: Path) -> None:
    n = 3000
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=_write_rows,
                                args=(str(tmp_path), m, n, 10, k, 2, barrier))
               for k, m in enumerate(("even", "odd"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert len(_parts(tmp_path)) == 2 * n // 10
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t["step"] == list(range(2 * n))
    assert t["shared"] == [float(s) for s in range(2 * n)]  # the metric both threads log
    assert t["even"][::2] == [float(s) for s in range(0, 2 * n, 2)]
    assert t["odd"][1::2] == [float(s) for s in range(1, 2 * n, 2)]


def test_one_recorder_shared_by_two_threads(tmp_path: Path) -> None:
    n = 2000
    rec = RunRecorder(tmp_path, part_steps=16)

    def work(metric: str) -> None:
        for s in range(n):
            rec.log(s, {metric: float(s)})

    threads = [threading.Thread(target=work, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    rec.close()
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t["step"] == list(range(n))
    assert t["a"] == t["b"] == [float(s) for s in range(n)]


@FORK
def test_two_writer_processes_keep_all_rows(tmp_path: Path) -> None:
    n = 2000
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_write_rows, args=(str(tmp_path), m, n, 10, 0, 1, barrier))
             for m in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(_parts(tmp_path)) == 2 * n // 10
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t["step"] == list(range(n))
    assert t["a"] == t["b"] == t["shared"] == [float(s) for s in range(n)]
    assert _hidden(tmp_path) == []


@FORK
def test_forked_child_does_not_flush_the_parents_rows(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path, part_steps=100)
    for s in range(10):
        rec.log(s, {"loss": float(s)})
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            rec._atexit_close()  # what the child's interpreter exit would call (inherited)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert _parts(tmp_path) == []
    rec.close()
    assert _column(tmp_path, "loss") == [float(s) for s in range(10)]


# ---------------------------------------------------------------------------- bad input
class _RaisingFloat:
    def __float__(self) -> float:
        raise ZeroDivisionError("boom")


class _BrokenMapping(Mapping[str, float]):
    def __getitem__(self, key: str) -> float:
        raise RuntimeError("broken")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("broken")

    def __len__(self) -> int:
        return 1


BAD_CALLS: dict[str, tuple[Any, Any, tuple[str, str]]] = {
    "step_2**70": (2**70, {"loss": 1.0}, ("bad_step", "int")),
    "step_below_int64": (-(2**63) - 1, {"loss": 1.0}, ("bad_step", "int")),
    "step_nan": (math.nan, {"loss": 1.0}, ("bad_step", "float")),
    "step_inf": (math.inf, {"loss": 1.0}, ("bad_step", "float")),
    "step_none": (None, {"loss": 1.0}, ("bad_step", "NoneType")),
    "lone_surrogate_name": ("STEP", {"\udc80": 1.0}, ("bad_name", "'\\udc80'")),
    "name_step": ("STEP", {"step": 5.0}, ("reserved_name", "step")),
    "name_not_str": ("STEP", {(1, 2): 1.0}, ("bad_name", "(1, 2)")),
    "value_text": ("STEP", {"x": "1.5"}, ("bad_value", "x")),
    "value_list": ("STEP", {"x": [1.0, 2.0]}, ("bad_value", "x")),
    "value_complex": ("STEP", {"x": 1 + 2j}, ("bad_value", "x")),
    "value_huge_int": ("STEP", {"x": 2**1100}, ("bad_value", "x")),
    "value_raising_float": ("STEP", {"x": _RaisingFloat()}, ("bad_value", "x")),
    "metrics_not_mapping": ("STEP", [("loss", 1.0)], ("bad_metrics", "list")),
    "metrics_none": ("STEP", None, ("bad_metrics", "NoneType")),
    "metrics_raising": ("STEP", _BrokenMapping(), ("bad_metrics", "RuntimeError")),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_is_skipped_recorded_and_later_rows_kept(tmp_path: Path, case: str) -> None:
    bad_step, bad_metrics, key = BAD_CALLS[case]
    rec = RunRecorder(tmp_path, part_steps=2)  # parts are written after the bad input
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(9):
            rec.log(s, {"loss": float(s), "val": None})  # None: "not logged", never a skip
            if s in (3, 6):  # twice: counted twice, warned once
                rec.log(s if bad_step == "STEP" else bad_step, bad_metrics)
    rec.close()
    assert rec.skipped == {key: 2}
    assert len([w for w in caught if issubclass(w.category, UserWarning)]) == 1
    assert caught[0].filename == __file__  # the warning points at the caller's log()
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t["step"] == list(range(9)) and t["loss"] == [float(s) for s in range(9)]
    assert set(t) == {"step", "loss"}  # no column from the bad input, none for all-None "val"


def test_metrics_named_name_and_value_stay_a_wide_run(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, part_steps=3) as rec:
        for s in range(5):
            rec.log(s, {"name": float(s), "value": 2.0 * s})
    t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t == {"step": list(range(5)), "name": [float(s) for s in range(5)],
                 "value": [2.0 * s for s in range(5)]}


def test_old_run_with_a_step_metric_is_readable(tmp_path: Path) -> None:
    """Parts written before ``step`` was reserved hold two ``step`` columns; the first is the
    step, the second (the user's metric) is dropped with a warning naming the file."""
    import pyarrow.parquet as pq

    from replay.schema import make_metadata, run_schema

    schema = run_schema(["loss", "step"], make_metadata())
    old = pa.Table.from_arrays([pa.array([0, 1]), pa.array([1.0, 2.0]), pa.array([9.0, 9.0])],
                               schema=schema)
    pq.write_table(old, tmp_path / part_name(0))
    with RunRecorder(tmp_path) as rec:
        rec.log(2, {"loss": 3.0})
    with pytest.warns(UserWarning, match=part_name(0)):
        t = read_run(tmp_path, default_aliases=False).to_pydict()
    assert t == {"step": [0, 1, 2], "loss": [1.0, 2.0, 3.0]}


def test_too_many_metric_names_are_capped(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path, part_steps=10, max_metrics=3)
    with pytest.warns(UserWarning, match="max_metrics=3"):
        for s in range(20):
            rec.log(s, {f"m{s}": 1.0, "m0": 0.0})
    rec.close()
    assert rec.skipped == {("too_many_metrics", ""): 17}
    assert read_run(tmp_path, default_aliases=False).column_names == ["step", "m0", "m1", "m2"]


_names = st.one_of(st.text(max_size=8), st.sampled_from(["step", "name", "value", "\udc80"]),
                   st.integers(), st.none())
_values = st.one_of(st.floats(), st.integers(min_value=-(2**1100), max_value=2**1100),
                    st.text(max_size=3), st.none(), st.complex_numbers(), st.booleans())
_steps = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(),
                   st.text(max_size=2), st.none())


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(_steps, st.dictionaries(_names, _values, max_size=4)),
                      max_size=25))
def test_random_input_never_raises_and_the_run_stays_readable(
        tmp_path_factory: pytest.TempPathFactory, calls: list[tuple[Any, dict[Any, Any]]]) -> None:
    d = tmp_path_factory.mktemp("fuzzrec")
    rec = RunRecorder(d, part_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, metrics in calls:
            rec.log(step, metrics)
        rec.log(2**63 - 1, {"sentinel": 1.0})  # a good row after whatever came before
        rec.close()
    t = read_run(d, default_aliases=False)
    assert t.column("step").to_pylist()[-1] == 2**63 - 1
    assert t.column("sentinel").to_pylist()[-1] == 1.0
    assert rec.rows_dropped == 0


# ---------------------------------------------------------------------------- read-only disk
def _failing_writes(monkeypatch: pytest.MonkeyPatch, code: int = errno.EROFS) -> list[int]:
    """Make every part write fail with ``code``; returns the row counts of the attempts."""
    attempts: list[int] = []

    def write(table: pa.Table, where: Any, **kw: Any) -> None:
        attempts.append(table.num_rows)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(recorder_mod.pq, "write_table", write)
    return attempts


def test_read_only_disk_keeps_the_users_exception(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_writes(monkeypatch)
    with pytest.warns(RuntimeWarning, match="could not write the last 5 buffered row"):
        with pytest.raises(KeyError, match="the user's own error"):
            with RunRecorder(tmp_path, part_steps=2) as rec:
                for s in range(5):
                    rec.log(s, {"loss": float(s)})  # part writes fail: never raises
                raise KeyError("the user's own error")
    assert rec.closed and rec.rows_dropped == 5


def test_read_only_disk_without_user_exception_still_raises_on_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_writes(monkeypatch)
    with pytest.raises(OSError, match="could not write the last 3 buffered row"):
        with RunRecorder(tmp_path, part_steps=10) as rec:
            for s in range(3):
                rec.log(s, {"loss": float(s)})


@LOCKS
def test_no_lock_file_possible_only_disables_the_lock(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    real_open = os.open

    def ro_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if ".writer-" in os.fspath(path) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(recorder_mod.os, "open", ro_open)
    with caplog.at_level(logging.WARNING, logger="replay.recorder"):
        rec = RunRecorder(tmp_path, part_steps=2)
    assert not rec.locked
    assert "recording without one" in caplog.records[0].getMessage()
    for s in range(5):
        rec.log(s, {"loss": float(s)})
    rec.close()
    assert _column(tmp_path, "loss") == [float(s) for s in range(5)]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_really_read_only_directory(tmp_path: Path) -> None:  # pragma: no cover - non-root CI
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        with pytest.warns(RuntimeWarning, match="buffered row"):
            with pytest.raises(ZeroDivisionError):
                with RunRecorder(d, part_steps=2) as rec:  # no lock file: a warning, not an error
                    for s in range(5):
                        rec.log(s, {"loss": float(s)})
                    1 / 0  # noqa: B018
    finally:
        d.chmod(0o755)
    assert os.listdir(d) == []


# ---------------------------------------------------------------------------- full disk
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_full_disk_bounded_memory_and_one_part_per_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    monkeypatch.setattr(recorder_mod.time, "monotonic", clock.monotonic)
    cap = 64 << 10
    rec = RunRecorder(tmp_path, part_steps=50, max_buffer_bytes=cap)
    metrics = {f"m{i}": float(i) for i in range(20)}
    attempts = _failing_writes(monkeypatch, errno.ENOSPC)
    arrow0 = pa.total_allocated_bytes()
    n_full = 20_000
    peak_queue = peak_arrow = 0
    with caplog.at_level(logging.WARNING, logger="replay.recorder"):
        for s in range(n_full):
            clock.now += 0.05  # 1000 s of "training" while the disk is full
            rec.log(s, metrics)
            peak_queue = max(peak_queue, rec.buffered_bytes)
            peak_arrow = max(peak_arrow, pa.total_allocated_bytes() - arrow0)
    part_bytes = 50 * (8 + 20 * 8) * 2  # generous: one part of 50 rows x 21 columns
    assert peak_queue <= cap + part_bytes
    assert peak_arrow <= cap + 4 * part_bytes  # Arrow memory actually held, not an estimate
    assert all(n == 50 for n in attempts)  # a retry writes one part, never everything queued
    # exponential backoff (1 s .. 60 s) over 1000 s: a few dozen tries, not one per part
    assert 5 <= len(attempts) <= 40, attempts
    assert rec.rows_dropped > 0
    assert rec.rows_dropped + rec.buffered_rows == n_full  # every row is accounted for
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "No space left" in msgs[0] and "max_buffer_bytes" in msgs[1]
    # the disk comes back: the queue drains (two parts per logged step) and nothing else is lost
    monkeypatch.setattr(recorder_mod.pq, "write_table", _real_write_table)
    clock.now += 61.0
    queued = rec.buffered_rows
    for s in range(n_full, n_full + 200):
        rec.log(s, metrics)
    rec.close()
    steps = read_run(tmp_path, default_aliases=False).column("step").to_pylist()
    kept = queued + 200
    assert steps == list(range(n_full + 200 - kept, n_full + 200))  # the newest rows survive
    assert rec.rows_dropped == n_full - queued


_real_write_table = recorder_mod.pq.write_table


def test_full_disk_with_flush_seconds_does_not_queue_tiny_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(recorder_mod.time, "monotonic", clock.monotonic)
    rec = RunRecorder(tmp_path, part_steps=100, flush_seconds=1.0)
    attempts = _failing_writes(monkeypatch, errno.ENOSPC)
    for s in range(1000):
        clock.now += 0.5  # flush_seconds would cut a part every other step
        rec.log(s, {"loss": float(s)})
    assert attempts and attempts[0] <= 2  # the first timed part, before the outage was known
    monkeypatch.setattr(recorder_mod.pq, "write_table", _real_write_table)
    clock.now += 61.0
    rec.close()
    assert len(_parts(tmp_path)) <= 1000 // 100 + 2  # parts of part_steps rows, not of two
    assert _column(tmp_path, "loss") == [float(s) for s in range(1000)]


def test_full_disk_at_close_reports_the_loss(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rec = RunRecorder(tmp_path, part_steps=10)
    for s in range(25):
        rec.log(s, {"loss": float(s)})
    attempts = _failing_writes(monkeypatch, errno.ENOSPC)
    for s in range(25, 40):
        rec.log(s, {"loss": float(s)})
    with pytest.raises(OSError, match="could not write the last 20 buffered row") as info:
        rec.close()
    assert info.value.errno == errno.ENOSPC
    assert attempts and all(n <= 10 for n in attempts)
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
    assert _column(tmp_path, "loss") == [float(s) for s in range(20)]


# ---------------------------------------------------------------------------- stale files
@LOCKS
def test_stale_temporary_files_are_removed_on_open(tmp_path: Path) -> None:
    with RunRecorder(tmp_path, part_steps=2) as rec:
        for s in range(4):
            rec.log(s, {"loss": float(s)})
    live = RunRecorder(tmp_path, part_steps=2)  # a writer that is still running
    dead = "4242-0badc0de"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        junk = {
            f".part-000007.{dead}.tmp": False,  # no lock file: its writer is gone
            f".writer-{dead[:-1]}f.lock": False,  # lock file nobody holds
            f".part-000008.{dead[:-1]}f.tmp": False,
            f".part-000009.{live.writer_id}.tmp": True,  # the live writer's part in flight
            f".part-000003.parquet.{dead_pid}.tmp": False,  # older naming, pid gone
            f".part-000004.parquet.{sleeper.pid}.tmp": True,  # older naming, pid alive
            "notes.tmp": True,  # not ours
        }
        for name in junk:
            (tmp_path / name).write_bytes(b"PAR1 half a part")
        RunRecorder(tmp_path).close()
        left = set(os.listdir(tmp_path))
        for name, kept in junk.items():
            assert (name in left) == kept, name
        assert f".writer-{live.writer_id}.lock" in left
        live.close()
        (tmp_path / f".part-000009.{live.writer_id}.tmp").unlink()  # as the live writer would
        RunRecorder(tmp_path).close()
        assert _hidden(tmp_path) == [f".part-000004.parquet.{sleeper.pid}.tmp"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _column(tmp_path, "loss") == [0.0, 1.0, 2.0, 3.0]


def _killed_mid_part(directory: str) -> None:
    real = recorder_mod.pq.write_table

    def torn(table: pa.Table, where: Any, **kw: Any) -> None:
        if int(table.column("step")[0].as_py()) >= 10:
            real(table, where, **kw)
            with open(where, "r+b") as f:
                f.truncate(os.path.getsize(where) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real(table, where, **kw)

    recorder_mod.pq.write_table = torn
    rec = RunRecorder(directory, part_steps=5)
    for s in range(20):
        rec.log(s, {"loss": float(s)})


@FORK
@LOCKS
def test_files_left_by_a_killed_writer_are_cleaned_on_the_next_open(tmp_path: Path) -> None:
    p = mp.get_context("fork").Process(target=_killed_mid_part, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    left = _hidden(tmp_path)
    assert any(n.endswith(".tmp") for n in left) and any(n.endswith(".lock") for n in left)
    assert _parts(tmp_path) == [part_name(0), part_name(1)]
    with RunRecorder(tmp_path, part_steps=5) as rec:
        assert rec.other_writers == 0  # the killed writer's lock is not held: not counted
        rec.log(10, {"loss": 10.0})
    assert _hidden(tmp_path) == []
    assert _column(tmp_path, "loss") == [float(s) for s in range(11)]
