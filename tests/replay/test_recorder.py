"""RunRecorder: parts, schema evolution, crash safety (exception, atexit, SIGKILL)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from replay.reader import read_run
from replay.recorder import RunRecorder, part_name
from replay.schema import read_metadata

REPO = Path(__file__).resolve().parents[2]


def parts(d: Path) -> list[str]:
    return sorted(p for p in os.listdir(d) if p.startswith("part-"))


def test_parts_and_schema_evolution(tmp_path):
    with RunRecorder(tmp_path, part_steps=3, metadata={"run": {"name": "r"}, "seed": 1}) as rec:
        for s in range(7):
            m = {"loss": 1.0 + s}
            if s >= 4:
                m["grad_norm/blk1"] = float(s)  # a layer that appears later
            rec.log(s, m)
    assert parts(tmp_path) == [part_name(0), part_name(1), part_name(2)]
    first = pq.read_schema(tmp_path / part_name(0))
    assert first.names == ["step", "loss"]
    md = read_metadata(first)
    assert md["run"] == {"name": "r", "seed": 1} and md["monitor_config"] is None
    t = read_run(tmp_path)
    assert t.column("step").to_pylist() == list(range(7))
    assert t.column("grad_norm/blk1").to_pylist() == [None] * 4 + [4.0, 5.0, 6.0]


def test_same_step_merged_and_missing_is_null(tmp_path):
    with RunRecorder(tmp_path, part_steps=10) as rec:
        rec.log(0, {"loss": 2.0})
        rec.log(0, {"val_loss": 2.5})
        rec.log(1, {"loss": math.nan, "val_loss": None})
    t = read_run(tmp_path).to_pydict()
    assert t["step"] == [0, 1]
    assert t["val_loss"] == [2.5, None]
    assert math.isnan(t["loss"][1])


def test_value_types(tmp_path):
    class F:  # what torch.Tensor / jax arrays offer: __float__ on one element
        def __float__(self) -> float:
            return 0.5

    with RunRecorder(tmp_path) as rec:
        rec.log(
            np.int64(3),
            {
                "a": np.float32(1.5),
                "b": np.float64(2.0),
                "c": 4,
                "d": True,
                "e": np.float16(3.0),
                "f": F(),
                "g": np.array(7.0),
                "h": math.inf,
            },
        )
    row = read_run(tmp_path).to_pylist()[0]
    assert row == {
        "step": 3,
        "a": 1.5,
        "b": 2.0,
        "c": 4.0,
        "d": 1.0,
        "e": 3.0,
        "f": 0.5,
        "g": 7.0,
        "h": math.inf,
    }


def test_non_numeric_skipped_with_one_warning(tmp_path):
    rec = RunRecorder(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(3):
            rec.log(s, {"loss": 1.0, "name": "run-a", "vec": [1, 2], "t": np.ones(3)})
    msgs = [str(x.message) for x in w]
    assert "metric 'name' has a non-numeric value of type str" in msgs[0]
    assert len(msgs) == 3
    assert sum("'name'" in m for m in msgs) == 1 and sum("'vec'" in m for m in msgs) == 1
    rec.close()
    assert read_run(tmp_path).column_names == ["step", "loss"]


def test_exception_in_with_block_flushes_and_propagates(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RunRecorder(tmp_path, part_steps=100) as rec:
            for s in range(5):
                rec.log(s, {"loss": float(s)})
            1 / 0  # noqa: B018
    assert rec.closed
    assert read_run(tmp_path).num_rows == 5


def test_close_idempotent_and_log_after_close(tmp_path):
    rec = RunRecorder(tmp_path)
    rec.log(0, {"a": 1.0})
    rec.close()
    rec.close()
    with pytest.warns(UserWarning, match="closed"):  # never raises into the training loop
        rec.log(1, {"a": 1.0})
    assert rec.skipped == {("closed", ""): 1}
    assert len(parts(tmp_path)) == 1
    empty = tmp_path / "empty"
    RunRecorder(empty).close()
    assert parts(empty) == []


def test_resume_continues_numbering(tmp_path):
    with RunRecorder(tmp_path, part_steps=2) as rec:
        for s in range(4):
            rec.log(s, {"loss": 1.0})
    with RunRecorder(tmp_path, part_steps=2) as rec:
        rec.log(2, {"loss": 0.5})  # rollback: re-runs step 2
        rec.log(4, {"loss": 0.4})
    assert parts(tmp_path) == [part_name(i) for i in range(3)]
    t = read_run(tmp_path).to_pydict()
    assert t["step"] == [0, 1, 2, 3, 4] and t["loss"][2] == 0.5


def test_flush_seconds(tmp_path):
    rec = RunRecorder(tmp_path, part_steps=1000, flush_seconds=0.01)
    rec.log(0, {"a": 1.0})
    time.sleep(0.02)
    rec.log(1, {"a": 1.0})
    assert len(parts(tmp_path)) == 1
    rec.close()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"^The 'part_steps' parameter of RunRecorder must be an "
                       r"int in the range \[1, inf\)\. Got 0 instead\.$"):
        RunRecorder(tmp_path, part_steps=0)
    with pytest.raises(ValueError, match=r"'flush_seconds' parameter of RunRecorder must be a "
                       r"float in the range \(0\.0, inf\] or None\. Got -1 instead"):
        RunRecorder(tmp_path, flush_seconds=-1)
    with pytest.raises(ValueError, match=r"'flush_seconds' parameter of RunRecorder .* Got True"):
        RunRecorder(tmp_path, flush_seconds=True)
    with pytest.raises(ValueError, match=r"'max_buffer_bytes' parameter of RunRecorder .* Got -1"):
        RunRecorder(tmp_path, max_buffer_bytes=-1)
    with pytest.raises(ValueError, match=r"'max_metrics' parameter of RunRecorder .* Got 0"):
        RunRecorder(tmp_path, max_metrics=0)
    # bad log() input is skipped with a warning, never raised into the training loop
    rec = RunRecorder(tmp_path)
    with pytest.warns(UserWarning, match="step 1.5 is not an integer"):
        rec.log(1.5, {"a": 1.0})
    with pytest.warns(UserWarning, match="step 'x' is not an integer"):
        rec.log("x", {"a": 1.0})
    with pytest.warns(UserWarning, match="metric names must be str"):
        rec.log(0, {1: 1.0})
    rec.close()
    assert rec.skipped == {("bad_step", "float"): 1, ("bad_step", "str"): 1,
                           ("bad_name", "1"): 1}


def test_leftover_temp_file_is_ignored(tmp_path):
    with RunRecorder(tmp_path, part_steps=2) as rec:
        for s in range(3):
            rec.log(s, {"a": 1.0})
    (tmp_path / ".part-000009.parquet.123.tmp").write_bytes(b"PAR1 half written")
    assert read_run(tmp_path).num_rows == 3


def _child(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from replay.recorder import RunRecorder
        rec = RunRecorder({str(tmp_path)!r}, part_steps=10)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_sigkill_loses_at_most_the_unflushed_part(tmp_path):
    proc = _child(
        tmp_path,
        """
        for s in range(57):
            rec.log(s, {"loss": float(s)})
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    t = read_run(tmp_path)
    # 57 rows logged; 5 closed parts of 10 survive; the buffered rows (50..56) are lost
    assert t.column("step").to_pylist() == list(range(50))


def test_atexit_flushes_on_normal_interpreter_exit(tmp_path):
    proc = _child(
        tmp_path,
        """
        for s in range(13):
            rec.log(s, {"loss": float(s)})
        """,
    )
    proc.wait(30)
    assert proc.returncode == 0
    assert read_run(tmp_path).num_rows == 13


def test_log_overhead_is_small(tmp_path):
    """Not a timing assertion: prints µs/log for the report (40 metrics per step)."""
    rec = RunRecorder(tmp_path, part_steps=1000)
    metrics = {f"grad_norm/blk{i}": 0.1 * i for i in range(40)}
    n = 2000
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(n):
            rec.log(s, metrics)
    dt = (time.perf_counter() - t0) / n * 1e6
    rec.close()
    print(f"RunRecorder.log: {dt:.1f} us per 40-metric step (incl. part writes)")
    assert read_run(tmp_path).num_rows == n


def test_full_disk_keeps_rows_and_close_reports(tmp_path, monkeypatch, caplog):
    import errno
    import logging

    import replay.recorder as recorder_mod

    def write(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    rec = recorder_mod.RunRecorder(tmp_path / "run", part_steps=2)
    monkeypatch.setattr(recorder_mod.pq, "write_table", write)
    with caplog.at_level(logging.WARNING, logger="replay.recorder"):
        for s in range(7):
            rec.log(s, {"loss": float(s)})  # never raises
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    assert rec.write_error is not None and rec.buffered_rows == 7
    assert not list((tmp_path / "run").glob("*.tmp"))  # no temporary files left behind
    with pytest.raises(OSError, match="could not write the last 7 buffered row"):
        rec.close()
    rec.close()  # idempotent
    assert rec.rows_dropped == 7
    assert sorted(os.listdir(tmp_path / "run")) == []  # the writer lock is gone too


def test_parts_carry_page_checksums(tmp_path):
    from replay.schema import RunFormatError

    with RunRecorder(tmp_path, part_steps=10, compression="none") as rec:
        for s in range(5):
            rec.log(s, {"loss": 1000.0 + s})
    part = next(tmp_path.glob("part-*.parquet"))
    raw = bytearray(part.read_bytes())
    i = bytes(raw).find(np.float64(1003.0).tobytes())  # the value in the (uncompressed) page
    assert i > 0
    raw[i] ^= 0x01  # 1003.0 -> a slightly different float: only the page checksum can tell
    part.write_bytes(bytes(raw))
    with pytest.raises(RunFormatError, match=part.name):
        read_run(tmp_path)
