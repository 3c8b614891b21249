"""Watcher soak (issue 27): ``stability watch`` through rotation, truncation, CRLF, a FIFO, a full
disk and SIGTERM with hooks still running.

A writer appends ``--rows`` JSONL rows (one step each, loss spikes every ``--spike-every`` steps so
the monitor intervenes and the hooks run) to ``metrics.jsonl`` while a ``stability watch`` process
follows it together with a FIFO that has no writer.  On the way:

* rows ``[rows/6, rows/4)`` end with CRLF;
* at ``rows/3`` the file is **rotated** (renamed to ``metrics.jsonl.1``, a new file started);
* from ``rows/2`` to ``2*rows/3`` the **disk is full** for the watcher's state saves (its
  ``_atomic_write`` raises ``ENOSPC`` while a marker file exists -- the child process installs
  that; nothing in the library knows about it);
* at ``3*rows/4`` the file is **copy-truncated** (after the watcher caught up, as logrotate's
  ``copytruncate`` expects);
* every intervention runs the hook ``sleep 600`` (with a child of its own), so hooks are still
  running when the watcher gets **SIGTERM** at the end.

Printed: rows written, steps judged, rows already seen, "job re-ran" rewinds, state-save
failures, seconds from SIGTERM to exit, hook processes left alive.  The promise: every row
judged once (judged == rows, rewinds == 0), exit within 2 s of SIGTERM, no hook left.

Run::

    python benchmarks/bench_watch_soak.py
    python benchmarks/bench_watch_soak.py --rows 20000 --burst 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import errno, os, sys
sys.path.insert(0, {root!r})
import replay.watch as watch
real = watch._atomic_write
def full_disk(path, text):
    if os.path.exists({marker!r}):
        raise OSError(errno.ENOSPC, "No space left on device (soak)")
    return real(path, text)
watch._atomic_write = full_disk
from replay.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _row(step: int, spike_every: int, crlf: bool) -> str:
    loss = 50.0 if step % spike_every == spike_every - 1 else 2.0 + 0.01 * (step % 7)
    return json.dumps({"step": step, "loss": loss, "grad_norm": 1.0}) + ("\r\n" if crlf else "\n")


def _state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait_judged(state: Path, n: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _state(state).get("hw", -1) >= n - 1:
            return True
        time.sleep(0.1)
    return False


def _alive(pids_file: Path) -> list[int]:
    out = []
    for pid in {int(x) for x in pids_file.read_text().split()} if pids_file.exists() else ():
        try:
            st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if st not in ("Z", "X"):
            out.append(pid)
    return out


def soak(rows: int, burst: int, spike_every: int, poll: float) -> str:
    d = Path(tempfile.mkdtemp(prefix="watch-soak-"))
    log, fifo, state = d / "metrics.jsonl", d / "fifo.jsonl", d / "state.json"
    marker, pids = d / "disk-full", d / "hook-pids"
    os.mkfifo(fifo)
    hook = f"sh -c 'echo $$ >> {pids}; sleep 600' & echo $$ >> {pids}; sleep 600"
    child = CHILD.format(root=str(ROOT), marker=str(marker))
    proc = subprocess.Popen(
        [sys.executable, "-c", child, "watch", str(log), str(fifo), "--state", str(state),
         "--save-every", "0.3", "--poll", str(poll), "--quiet", "--on", f"any={hook}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    fh = open(log, "a", newline="")
    try:
        end = time.monotonic() + 120.0
        while not state.exists() and time.monotonic() < end:  # the watcher is up and polling
            time.sleep(0.1)
        for lo in range(0, rows, burst):
            if lo == rows // 3:  # rotation
                fh.close()
                os.replace(log, d / "metrics.jsonl.1")
                fh = open(log, "a", newline="")
            if lo == rows // 2:
                marker.touch()  # the disk is full for the watcher's state (a few saves)
                time.sleep(1.0)
            if lo == 2 * rows // 3:
                marker.unlink()
            if lo == 3 * rows // 4:  # copytruncate, once the watcher caught up
                _wait_judged(state, lo, 60.0)
                fh.flush()
                shutil.copyfile(log, d / "metrics.jsonl.2")
                fh.truncate(0)
                fh.seek(0)
            for s in range(lo, min(lo + burst, rows)):
                fh.write(_row(s, spike_every, rows // 6 <= s < rows // 4))
            fh.flush()
            time.sleep(0.05)
        fh.close()
        caught_up = _wait_judged(state, rows, 120.0)
        hooks_running = len(_alive(pids))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.3)
    left = _alive(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    st = _state(state)
    c = st.get("counts", {})
    judged = c.get("steps_judged")
    ok = (judged == rows and c.get("resumes") == 0 and took < 2.0 and not left
          and proc.returncode == 0)
    err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()
    full = any("cannot save the watch state" in ln for ln in err)
    fifo_seen = any("not a regular file" in ln for ln in err)
    ok = ok and full and fifo_seen
    return (f"watch soak: {rows} rows (rotation, CRLF, full disk, copytruncate, a FIFO): "
            f"{judged} judged, {c.get('already_seen')} already seen, {c.get('resumes')} "
            f"rewinds, caught up: {caught_up}; full disk reported and survived: {full}; FIFO "
            f"reported, not opened: {fifo_seen}; SIGTERM with {hooks_running} hook processes "
            f"running: exit {proc.returncode} after {took:.2f} s, {len(left)} left alive -> "
            f"{'OK' if ok else 'FAIL'}" + (f"\n  last stderr line: {err[-1]}" if err else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--burst", type=int, default=50)
    ap.add_argument("--spike-every", type=int, default=400)
    ap.add_argument("--poll", type=float, default=0.2)
    args = ap.parse_args()
    print(soak(args.rows, args.burst, args.spike_every, args.poll), flush=True)


if __name__ == "__main__":
    main()
