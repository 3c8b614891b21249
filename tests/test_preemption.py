"""SIGTERM (preemption) runs an emergency checkpoint once, then the previous handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from stability.run.preemption import SigtermCheckpoint, install_sigterm_checkpoint

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

CHILD = textwrap.dedent("""
    import signal, sys, time
    from stability.run.preemption import install_sigterm_checkpoint

    path, mode = sys.argv[1], sys.argv[2]
    if mode == "custom":
        def previous(signum, frame):
            with open(path + ".previous", "a") as f:
                f.write(f"previous {signum}\\n")
            sys.exit(3)
        signal.signal(signal.SIGTERM, previous)

    step = 0

    def checkpoint():
        with open(path, "a") as f:
            f.write(f"checkpoint at step {step}\\n")
        if mode == "failing":
            raise RuntimeError("disk full")

    install_sigterm_checkpoint(checkpoint)
    while True:                      # a tiny training loop
        step += 1
        if step == 1:                # ready once inside it: the signal cannot come before
            print("ready", flush=True)
        time.sleep(0.001)
""")


def run_child(tmp_path: Path, mode: str) -> tuple[int, list[str]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ckpt = tmp_path / "ckpt.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = ckpt.read_text().splitlines() if ckpt.exists() else []
    return rc, lines


def test_default_handler_checkpoint_once_then_terminated(tmp_path: Path) -> None:
    rc, lines = run_child(tmp_path, "default")
    assert rc == -signal.SIGTERM                     # exits as it would have without us
    assert len(lines) == 1 and lines[0].startswith("checkpoint at step ")
    assert int(lines[0].rsplit(" ", 1)[1]) >= 1      # taken from inside the running loop


def test_previous_python_handler_is_chained(tmp_path: Path) -> None:
    rc, lines = run_child(tmp_path, "custom")
    assert rc == 3
    assert len(lines) == 1
    assert (tmp_path / "ckpt.txt.previous").read_text() == f"previous {int(signal.SIGTERM)}\n"


def test_failing_checkpoint_still_exits(tmp_path: Path) -> None:
    rc, lines = run_child(tmp_path, "failing")
    assert rc == -signal.SIGTERM and len(lines) == 1


def test_uninstall_restores_previous_handler() -> None:
    seen: list[int] = []

    def mine(signum: int, frame: object) -> None:
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, mine)
    try:
        calls: list[str] = []
        with install_sigterm_checkpoint(lambda: calls.append("c"), signals=[signal.SIGUSR1]) as h:
            assert h.installed and signal.getsignal(signal.SIGUSR1) == h._handle
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == ["c"]                      # once
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]    # chained both times
        assert h.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) is mine    # restored
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_not_main_thread_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    out: list[SigtermCheckpoint] = []
    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=lambda: out.append(install_sigterm_checkpoint(lambda: None)))
    t.start()
    t.join()
    assert not out[0].installed and signal.getsignal(signal.SIGTERM) == before
    assert "not the main thread" in caplog.text


TORCH_CHILD = textwrap.dedent("""
    import sys
    import torch
    from stability.adapters.torch import TorchGuard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = TorchGuard(model, opt, checkpoint_dir=sys.argv[1], checkpoint_every=0,
                       checkpoint_on_sigterm=True)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for i in range(10**7):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)
        if i == 3:
            print("ready", flush=True)
""")


def test_torch_guard_checkpoints_at_the_step_boundary_on_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import json

    script = tmp_path / "child.py"
    script.write_text(TORCH_CHILD)
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == -signal.SIGTERM
    rows = json.loads((ckpt / "index.json").read_text())["entries"]
    assert [r["reason"] for r in rows] == ["sigterm"] and rows[0]["step"] >= 3
    assert (ckpt / rows[0]["file"]).is_file()
