"""``stability watch`` / :class:`replay.watch.Watcher`: live logs give the replay's decisions.

The oracle is :func:`replay.replay.replay_run` on the finished file (the monitor's batch path):
following a file as it grows -- across ``--once`` restarts with a state file, a rotation, a
truncation, partial lines and partial TFRecords, another process appending -- must raise the same
alarms and request the same interventions at the same steps.
"""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.cli import main
from replay.importers.tensorboard import write_scalar_events
from replay.replay import replay_run
from replay.watch import Watcher, detect_watch_format, parse_hooks
from stability.monitor.monitor import Monitor


# ---------------------------------------------------------------------------- data
def _rows(n: int = 400, seed: int = 0, start: int = 0, spikes: tuple[int, ...] = (150, 260),
          nan_at: int | None = 330) -> list[dict[str, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(start, start + n):
        loss = 3.0 * math.exp(-s / 300) + 0.5 + 0.02 * float(rng.standard_normal())
        gn = 1.0 + 0.05 * float(rng.standard_normal())
        if s in spikes:
            loss *= 8.0
            gn *= 30.0
        if s == nan_at:
            loss = float("nan")
        out.append({"step": s, "loss": loss, "lr": 1e-3, "grad_norm": gn})
    return out


def _jsonl(rows: list[dict[str, float]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _megatron(rows: list[dict[str, float]]) -> str:
    return "".join(
        f" iteration {int(r['step']):8d}/ 100000 | learning rate: {r['lr']:.6E} | "
        f"lm loss: {r['loss']:.6E} | grad norm: {r['grad_norm']:.4f} |\n" for r in rows)


def _key(decisions: Any) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]]]:
    alarms = sorted((a.step, a.kind, a.signal, a.detector) for d in decisions for a in d.alarms)
    ivs = sorted((i.step, i.type) for d in decisions for i in d.interventions)
    return alarms, ivs


def _oracle(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[int, str]]]:
    res = replay_run(path, "default")
    alarms = sorted((a.step, a.kind, a.signal, a.detector) for a in res.alarms)
    return alarms, sorted((i.step, i.type) for i in res.interventions)


def _once(paths: list[Path], state: Path | None = None, **kw: Any) -> list[Any]:
    w = Watcher([str(p) for p in paths], "default", state=None if state is None else str(state),
                echo=None, **kw)
    try:
        return w.run(once=True)
    finally:
        w.close()


@pytest.fixture(scope="module")
def rows() -> list[dict[str, float]]:
    return _rows()


# ---------------------------------------------------------------------------- basics
def test_the_fixture_run_has_alarms_and_interventions(tmp_path: Path, rows: list[Any]) -> None:
    ref = tmp_path / "ref.jsonl"
    ref.write_text(_jsonl(rows))
    alarms, ivs = _oracle(ref)
    assert {s for s, *_ in alarms} >= {150, 260, 330}
    assert ivs  # the tests below compare non-trivial decisions


def test_detect_watch_format(tmp_path: Path) -> None:
    assert detect_watch_format(str(tmp_path / "later.jsonl")) == "jsonl"
    assert detect_watch_format(str(tmp_path / "missing")) is None
    (tmp_path / "tb").mkdir()
    assert detect_watch_format(str(tmp_path / "tb")) is None  # no event file yet
    write_scalar_events(tmp_path / "tb" / "events.out.tfevents.1", [(0, {"loss": 1.0})])
    assert detect_watch_format(str(tmp_path / "tb")) == "tensorboard"
    with pytest.raises(ValueError, match="unknown kind"):
        parse_hooks(["explode=rm -rf /"])


def test_appended_jsonl_with_state_equals_one_run_and_replay(tmp_path: Path,
                                                             rows: list[Any]) -> None:
    ref = tmp_path / "ref.jsonl"
    ref.write_text(_jsonl(rows))
    expected = _oracle(ref)
    assert _key(_once([ref])) == expected

    log, state = tmp_path / "live.jsonl", tmp_path / "state.json"
    decisions: list[Any] = []
    for lo, hi in ((0, 90), (90, 155), (155, 156), (156, 331), (331, 400)):
        with log.open("a") as fh:
            fh.write(_jsonl(rows[lo:hi]))
        decisions += _once([log], state)
        assert json.loads(state.read_text())["hw"] == hi - 1
    assert _key(decisions) == expected
    assert sorted(d.step for d in decisions) == list(range(400))  # each step judged once
    assert _once([log], state) == []  # nothing new: nothing judged


def test_state_restores_detectors_not_rewarming(tmp_path: Path, rows: list[Any]) -> None:
    """Without the state a restarted watcher would re-warm; with it, decisions continue."""
    log, state = tmp_path / "live.jsonl", tmp_path / "state.json"
    log.write_text(_jsonl(rows[:200]))
    _once([log], state)
    saved = json.loads(state.read_text())
    fresh = Monitor("default", alert_sinks=[])
    fresh.load_state_dict(saved["monitor"])
    assert fresh.last_step == 199
    assert saved["sources"][str(log)]["tail"]["offset"] == log.stat().st_size


def test_partial_last_line_waits_for_its_end(tmp_path: Path, rows: list[Any]) -> None:
    log = tmp_path / "m.log"
    text = _megatron(rows[:50])
    log.write_text(text[:-30])  # the last line is cut mid-way
    w = Watcher([str(log)], "default", echo=None)
    first = w.run(once=True)
    assert [d.step for d in first] == list(range(49))
    with log.open("a") as fh:
        fh.write(text[-30:])
    assert [d.step for d in w.run(once=True)] == [49]
    w.close()


# ---------------------------------------------------------------------------- rotation etc.
def test_rotation_and_truncation_give_replay_decisions(tmp_path: Path, rows: list[Any]) -> None:
    ref = tmp_path / "ref.jsonl"
    ref.write_text(_jsonl(rows))
    expected = _oracle(ref)
    log, state = tmp_path / "train.jsonl", tmp_path / "state.json"
    decisions: list[Any] = []
    log.write_text(_jsonl(rows[:120]))
    decisions += _once([log], state)
    # rotation: logrotate moves the file away, the job opens a new one
    log.rename(tmp_path / "train.jsonl.1")
    log.write_text(_jsonl(rows[120:200]))
    decisions += _once([log], state)
    # copytruncate, already refilled past the old offset before the watcher looks again
    log.write_text(_jsonl(rows[200:400]))
    decisions += _once([log], state)
    assert _key(decisions) == expected
    assert sorted(d.step for d in decisions) == list(range(400))


def test_a_reread_is_skipped_a_rerun_is_a_resume(tmp_path: Path, rows: list[Any]) -> None:
    log = tmp_path / "train.jsonl"
    log.write_text(_jsonl(rows[:200]))
    w = Watcher([str(log)], "default", echo=None)
    w.run(once=True)
    # the same content again in a new file (a copy): already seen, nothing judged twice
    tmp = tmp_path / "copy.jsonl"
    tmp.write_text(_jsonl(rows[:200]))
    tmp.replace(log)
    assert w.run(once=True) == []
    assert w.already_seen == 200 and w.resumes == 0
    # the job restarts from its step-149 checkpoint and re-runs 150.. with other values
    rerun = _rows(150, seed=7, start=150, spikes=(250,), nan_at=None)
    with log.open("a") as fh:
        fh.write(_jsonl(rerun))
    got = w.run(once=True)
    w.close()
    assert w.resumes == 1
    assert [d.step for d in got] == list(range(150, 300))
    oracle = Monitor("default", alert_sinks=[])
    for r in rows[:200]:
        oracle.observe(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
    oracle.rewind(149)
    want = [oracle.observe(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
            for r in rerun]
    assert _key(got) == _key(want)
    assert 250 in {a.step for d in got for a in d.alarms}


# ---------------------------------------------------------------------------- another process
_WRITER = r"""
import base64, json, os, sys
for line in sys.stdin:
    op = json.loads(line)
    if op[0] == "append":
        with open(op[1], "ab") as fh:
            fh.write(base64.b64decode(op[2]))
    elif op[0] == "rotate":
        os.replace(op[1], op[2])
    elif op[0] == "truncate":
        with open(op[1], "r+b") as fh:
            fh.truncate(0)
    print("ok", flush=True)
"""


def _run_writer(ops: list[list[Any]], watcher: Watcher) -> list[Any]:
    """Another process performs ``ops`` one by one; the watcher polls after each."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    out: list[Any] = []
    try:
        for op in ops:
            proc.stdin.write(json.dumps(op) + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            if op[-1] != "no poll":
                out += watcher.poll()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    return out + watcher.run(once=True)


def _chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in sizes:
        out.append(data[pos:pos + n])
        pos += n
    out.append(data[pos:])
    return [c for c in out if c]


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def test_megatron_log_appended_by_another_process(tmp_path: Path, rows: list[Any]) -> None:
    ref = tmp_path / "ref.log"
    ref.write_text(_megatron(rows))
    expected = _oracle(ref)
    log = tmp_path / "train.log"
    a = _megatron(rows[:140]).encode()
    b = _megatron(rows[140:270]).encode()
    c = _megatron(rows[270:]).encode()
    ops: list[list[Any]] = [["append", str(log), _b64(x)] for x in _chunks(a, [5000, 77, 9000])]
    # the job writes its last lines, then the file is rotated before the watcher looks again:
    # those lines are read from the rotated file through the descriptor the watcher holds
    ops[-1].append("no poll")
    ops.append(["rotate", str(log), str(tmp_path / "train.log.1"), "no poll"])
    ops += [["append", str(log), _b64(x)] for x in _chunks(b, [3333, 8000])]
    ops.append(["truncate", str(log)])
    ops += [["append", str(log), _b64(x)] for x in _chunks(c, [100, 6000])]
    w = Watcher([str(log)], "default", echo=None)
    got = _run_writer(ops, w)
    w.close()
    assert _key(got) == expected
    assert sorted(d.step for d in got) == list(range(400))


def test_tensorboard_dir_appended_by_another_process(tmp_path: Path, rows: list[Any]) -> None:
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()

    def events(rs: list[Any], name: str, where: Path) -> bytes:
        p = where / name
        write_scalar_events(p, [(int(r["step"]), {"train/loss": r["loss"], "lr": r["lr"],
                                                 "grad_norm": r["grad_norm"]}) for r in rs])
        return p.read_bytes()

    first = events(rows[:250], "events.out.tfevents.1.host", ref_dir)
    second = events(rows[250:], "events.out.tfevents.2.host", ref_dir)  # the job restarted
    expected = _oracle(ref_dir)
    live = tmp_path / "tb"
    live.mkdir()
    f1, f2 = live / "events.out.tfevents.1.host", live / "events.out.tfevents.2.host"
    ops = [["append", str(f1), _b64(x)] for x in _chunks(first, [1001, 2500, 13, 4000])]
    ops += [["append", str(f2), _b64(x)] for x in _chunks(second, [777, 3000])]
    w = Watcher([str(live)], "default", echo=None)
    got = _run_writer(ops, w)
    w.close()
    assert _key(got) == expected
    assert sorted(d.step for d in got) == list(range(400))


def test_recorder_parts_directory(tmp_path: Path, rows: list[Any]) -> None:
    from replay.recorder import RunRecorder

    run = tmp_path / "run"
    w = Watcher([str(run)], "default", format="parquet", echo=None)
    got: list[Any] = []
    with RunRecorder(run, part_steps=64) as rec:
        for r in rows:
            rec.log(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
            if int(r["step"]) % 100 == 99:
                got += w.poll()
    got += w.run(once=True)
    w.close()
    assert _key(got) == _oracle(run)


# ---------------------------------------------------------------------------- CLI + actions
def test_cli_watch_hooks_control_file_and_events(tmp_path: Path, rows: list[Any],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "train.jsonl"
    log.write_text(_jsonl(rows))
    _, ivs = _oracle(log)
    hooks_out = tmp_path / "hooks.txt"
    ctl, events, state = tmp_path / "control.json", tmp_path / "ev.jsonl", tmp_path / "st.json"
    rc = main(["watch", str(log), "--once", "--state", str(state), "--events", str(events),
               "--control-file", str(ctl),
               "--on", f"skip_step=echo $STABILITY_STEP $STABILITY_KIND >> {hooks_out}"])
    assert rc == 0
    out = capsys.readouterr()
    assert "step 150:" in out.out and "steps judged" in out.err
    skip_steps = [s for s, t in ivs if t == "skip_step"]
    assert skip_steps
    lines = hooks_out.read_text().split("\n")[:-1]
    assert lines == [f"{s} skip_step" for s in skip_steps]
    doc = json.loads(ctl.read_text())
    assert doc["step"] == max(s for s, _ in ivs)
    assert set(doc["control"]) >= {"lr_factor", "clip_norm", "skip_step", "stop"}
    recs = [json.loads(x) for x in events.read_text().splitlines()]
    assert {r["step"] for r in recs if r.get("type") == "alarm"} >= {150, 260, 330}
    assert json.loads(state.read_text())["hw"] == 399


def test_cli_watch_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    assert main(["watch", str(tmp_path / "x.jsonl"), "--once", "--on", "nope=true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stability watch: error:") and "unknown kind" in err
    bad = tmp_path / "state.json"
    bad.write_text("{not json")
    assert main(["watch", str(tmp_path / "x.jsonl"), "--once", "--state", str(bad)]) == 2
    assert "unusable watch state" in capsys.readouterr().err


def test_a_failing_hook_never_stops_the_watcher(tmp_path: Path, rows: list[Any]) -> None:
    log = tmp_path / "train.jsonl"
    log.write_text(_jsonl(rows))
    w = Watcher([str(log)], "default", echo=None, hooks={"any": "exit 3"})
    got = w.run(once=True)
    w.close()
    assert len(got) == 400 and w.hook_runs > 0 and w.hook_failures == w.hook_runs


def test_missing_source_waits(tmp_path: Path, rows: list[Any]) -> None:
    log = tmp_path / "later.log"
    w = Watcher([str(log)], "default", echo=None)
    assert w.run(once=True) == []
    log.write_text(_megatron(rows[:10]))
    assert len(w.run(once=True)) == 10
    w.close()


def test_watch_uri_source(tmp_path: Path, rows: list[Any]) -> None:
    log = tmp_path / "train.jsonl"
    log.write_text(_jsonl(rows[:100]))
    uri = "file://" + str(log)
    w = Watcher([uri], "default", echo=None)
    got = w.run(once=True)
    with log.open("a") as fh:
        fh.write(_jsonl(rows[100:]))
    got += w.run(once=True)
    w.close()
    ref = tmp_path / "ref.jsonl"
    ref.write_text(_jsonl(rows))
    assert _key(got) == _oracle(ref)


def test_state_file_is_written_atomically(tmp_path: Path, rows: list[Any]) -> None:
    log, state = tmp_path / "a.jsonl", tmp_path / "s" / "state.json"
    log.write_text(_jsonl(rows[:20]))
    _once([log], state)
    assert json.loads(state.read_text())["version"] == 1
    assert [p.name for p in state.parent.iterdir()] == ["state.json"]  # no temporary left
    assert os.access(state, os.R_OK)


def test_a_long_backlog_is_read_over_several_polls(tmp_path: Path, rows: list[Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import replay.watch_sources

    monkeypatch.setattr(replay.watch_sources, "POLL_BYTES", 3000)  # about 30 lines per poll
    log = tmp_path / "train.log"
    log.write_text(_megatron(rows))
    w = Watcher([str(log)], "default", echo=None)
    first = w.poll()
    assert 0 < len(first) < 100  # a part of the file only
    got = first + w.run(once=True)
    w.close()
    assert _key(got) == _oracle(log)
    assert sorted(d.step for d in got) == list(range(400))


@pytest.mark.parametrize("poll_bytes", [64 << 20, 3000])
def test_backlog_quiet_warms_on_history_and_acts_on_new_steps(
        tmp_path: Path, rows: list[Any], poll_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import replay.watch_sources

    monkeypatch.setattr(replay.watch_sources, "POLL_BYTES", poll_bytes)
    log, hooks_out = tmp_path / "train.jsonl", tmp_path / "hooks.txt"
    log.write_text(_jsonl(rows[:200]))  # history, with the spike at 150
    sent: list[Any] = []
    w = Watcher([str(log)], "default", echo=None, backlog="quiet",
                hooks={"any": f"echo $STABILITY_STEP >> {hooks_out}"})

    class Sink:
        def send(self, alert: Any) -> None:
            sent.append(alert.step)

    w.monitor.alert_sinks = [Sink()]
    first = w.run(once=True)
    assert [d.step for d in first] == list(range(200))
    assert 150 in {a.step for d in first for a in d.alarms}  # judged...
    assert not hooks_out.exists() and sent == []  # ... but nothing acted on
    with log.open("a") as fh:
        fh.write(_jsonl(rows[200:]))
    later = w.run(once=True)
    w.close()
    acted = sorted({d.step for d in later if d.interventions})
    assert acted and acted[0] >= 200
    assert sorted({int(x) for x in hooks_out.read_text().split()}) == acted
    assert sent and min(sent) >= 200


def test_sigterm_saves_the_state(tmp_path: Path, rows: list[Any]) -> None:
    import time

    log, state = tmp_path / "train.jsonl", tmp_path / "state.json"
    log.write_text(_jsonl(rows[:100]))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "replay.cli", "watch", str(log), "--state",
                             str(state), "--poll", "0.05", "--save-every", "3600", "-q"],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        # wait until the watcher has started polling (its state is saved only on exit here)
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
            if proc.poll() is not None:
                break
            if _polled(log):
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read() if proc.stderr else ""
    st = json.loads(state.read_text())
    # every row read is either judged or saved as pending: nothing lost to the signal
    assert max([st["hw"]] + [s for s, _ in st["pending"]]) == 99
    w = Watcher([str(log)], "default", state=str(state), echo=None)
    rest = w.run(once=True)
    w.close()
    assert [d.step for d in rest] == list(range(st["hw"] + 1, 100))


def _polled(log: Path) -> bool:
    """True once some process holds ``log`` open (the watcher has read it)."""
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == str(log):
                    return True
        except OSError:
            continue
    return False
