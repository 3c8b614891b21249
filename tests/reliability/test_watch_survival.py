"""``stability watch`` never dies or stalls (issue 27, item 5; damaged state from item 9).

A stray CR in a CSV row, a FIFO without a writer, a full disk at a state save, a damaged state
file, hooks that hang (with children), a long stretch of non-metric lines before a spike, and
several sources holding slightly different values of one step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from replay import watch_sources
from replay.watch import Watcher


def _jsonl(path: Path, steps: range, spike: int = -1) -> None:
    with open(path, "a") as fh:
        for s in steps:
            loss = 40.0 if s == spike else 2.0 + 0.01 * (s % 3) + 1e-7 * s
            fh.write(json.dumps({"step": s, "loss": loss}) + "\n")


def test_a_stray_cr_in_a_csv_row_is_a_skipped_line(tmp_path) -> None:
    p = tmp_path / "m.csv"
    p.write_bytes(b"step,loss\n0,2.0\n1,2.0\r3\n2,2.1\r\n3,2.0\n")
    w = Watcher([str(p)], "default", echo=None)
    w.run(once=True)
    assert w.steps_judged == 3  # rows 0, 2 (CRLF) and 3; the damaged row is counted


def test_a_fifo_without_a_writer_never_blocks(tmp_path) -> None:
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    other = tmp_path / "other.jsonl"
    _jsonl(other, range(20))
    t0 = time.monotonic()
    w = Watcher([str(fifo), str(other)], "default", echo=None)
    w.run(once=True)
    assert time.monotonic() - t0 < 10 and w.steps_judged == 20


def test_a_full_disk_at_a_state_save_does_not_kill_the_watcher(tmp_path, monkeypatch,
                                                               caplog) -> None:
    p = tmp_path / "m.jsonl"
    _jsonl(p, range(30))
    state = tmp_path / "state.json"

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("replay.watch._atomic_write", full)
    w = Watcher([str(p)], "default", state=str(state), echo=None, save_every=0.0)
    w.run(max_polls=3, poll=0.01)
    assert w.steps_judged == 30 and w.save_failures >= 2
    assert caplog.text.count("cannot save the watch state") == 1


@pytest.mark.parametrize("key, value", [
    ("hw", "1e999"), ("hw", "Infinity"), ("monitor", "null"), ("pending", "[[1, null]]"),
    ("sources", '{"SRC": {"tail": {"offset": "many"}}}'), ("sources", '{"SRC": [1]}'),
    ("counts", '{"steps_judged": 1e999}'), ("prev", '{"SRC": -Infinity}'),
])
def test_a_damaged_state_file_is_an_unusable_watch_state(tmp_path, key, value) -> None:
    src = tmp_path / "x.jsonl"
    _jsonl(src, range(30))
    state = tmp_path / "state.json"
    w = Watcher([str(src)], "default", state=str(state), echo=None)
    w.run(once=True)
    doc = json.loads(state.read_text())
    doc[key] = "@@"
    state.write_text(json.dumps(doc).replace('"@@"', value.replace("SRC", str(src))))
    with pytest.raises(ValueError, match="unusable watch state"):
        Watcher([str(src)], "default", state=str(state), echo=None)


def test_once_reads_to_the_end_past_a_long_stretch_of_other_lines(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(watch_sources, "POLL_BYTES", 4096)
    p = tmp_path / "train.log"
    _jsonl(p, range(60))
    with open(p, "a") as fh:
        for i in range(2000):
            fh.write(json.dumps({"note": f"checkpointing shard {i}"}) + "\n")  # no step
    _jsonl(p, range(60, 120), spike=110)
    w = Watcher([str(p)], "default", echo=None, format="jsonl")
    ds = w.run(once=True)
    assert 110 in {a.step for d in ds for a in d.alarms}
    assert w.steps_judged == 120


def test_sources_with_rounded_or_other_ranks_values_judge_each_step_once(tmp_path) -> None:
    a, b = tmp_path / "rank0.jsonl", tmp_path / "rank1.csv"
    w = Watcher([str(a), str(b)], "default", echo=None)
    for lo in range(0, 400, 50):  # the CSV lags one poll behind the JSONL
        _jsonl(a, range(lo, lo + 50))
        w.poll()
        with open(b, "a") as fh:  # the same job as a %.6g CSV, and another rank's values
            if lo == 0:
                fh.write("step,loss\n")
            for s in range(lo, lo + 50):
                fh.write(f"{s},{2.0 + 0.01 * (s % 3) + (0.003 if s % 2 else 0.0):.6g}\n")
        w.poll()
    w.run(once=True)
    assert w.steps_judged == 400 and w.resumes == 0


def test_a_rerun_of_one_stream_is_still_a_rerun(tmp_path) -> None:
    p = tmp_path / "m.jsonl"
    _jsonl(p, range(50))
    w = Watcher([str(p)], "default", echo=None)
    w.run(once=True)
    with open(p, "a") as fh:  # restarted from step 40, new values
        for s in range(40, 60):
            fh.write(json.dumps({"step": s, "loss": 2.5 + 0.01 * s}) + "\n")
    w.run(once=True)
    assert w.resumes == 1 and w.steps_judged == 50 + 20


_CHILD = textwrap.dedent("""
    import sys
    from replay.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigterm_with_hanging_hooks_exits_within_two_seconds(tmp_path) -> None:
    p = tmp_path / "m.jsonl"
    _jsonl(p, range(200), spike=150)
    pids = tmp_path / "pids"
    hook = f"sh -c 'echo $$ >> {pids}; sleep 300' & echo $$ >> {pids}; sleep 300"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "watch", str(p), "--on", f"alarm={hook}",
         "--state", str(tmp_path / "state.json"), "--poll", "0.2", "--quiet"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and took < 2.0, (took, proc.stderr.read() if proc.stderr else "")
    time.sleep(0.2)
    alive = []
    for pid in {int(x) for x in pids.read_text().split()}:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):  # (a killed orphan may wait as a zombie for init)
            alive.append(pid)
    assert alive == []  # the hook's shell and its child: the whole process group went
    assert json.loads((tmp_path / "state.json").read_text())["version"] == 1
