"""A tiny, fully deterministic training loop with a monitor, a recorder and an event log.

Run in a forked child by ``test_crash_resume.py``; the child kills itself with ``SIGKILL`` at a
chosen ``(step, phase)`` and a second child resumes from the last checkpoint.  Everything the
loop decides goes to ``decisions.jsonl`` (one JSON line per step, floats written with ``repr``
precision, so comparing lines is a bit-for-bit comparison).

The loop acts on the monitor's ``Control``: LR factor, clip norm and skipped steps (a rollback or
stop request is recorded but not acted on -- this loop checks the monitor/recorder/event-log
crash contract, the rollback machinery is covered by the adapter tests).

Phases
    ``before_observe`` / ``after_observe`` -- kill around ``Monitor.observe`` of the step;
    ``ckpt_write`` -- kill half-way through writing the checkpoint of the step (tmp file);
    ``part_write`` -- kill half-way through the first Parquet part written at or after the step;
    ``torn_event`` -- write half an event record, then kill (a write torn by a crash).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np

N_STEPS = 240
CKPT_EVERY = 10
PART_STEPS = 16
SPIKES = {60: 40.0, 61: 40.0, 130: 25.0, 175: 60.0}
NAN_STEPS = {150}
PHASES = ("before_observe", "after_observe", "ckpt_write", "part_write", "torn_event")

CONFIG: dict[str, Any] = {
    "detectors": [
        {"name": "nonfinite", "detector": "nonfinite", "inputs": ["*"], "kind": "nonfinite"},
        {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"], "kind": "loss_spike",
         "params": {"warmup": 20, "alpha": 0.05, "log_space": True}},
        {"name": "loss_robust", "detector": "robust_z", "inputs": ["loss"], "kind": "loss_spike",
         "params": {"window": 32, "warmup": 20, "threshold": 8.0}},
        {"name": "grad_layers", "detector": "ewma_z", "inputs": ["grad_norm/*"],
         "kind": "grad_explosion", "params": {"warmup": 20, "alpha": 0.05, "log_space": True}},
        {"name": "grad", "detector": "ratio", "inputs": ["grad_norm"], "kind": "grad_explosion"},
    ],
}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _batch(step: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((16, 8))
    y = np.sin(x.sum(axis=1, keepdims=True))
    if step in SPIKES:
        y = y * SPIKES[step]
    if step in NAN_STEPS:
        x[0, 0] = math.nan
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)


def _append(fd: int, obj: Any) -> None:
    os.write(fd, (json.dumps(obj, separators=(",", ":")) + "\n").encode())


def _save_ckpt(path: Path, payload: dict[str, Any], torn: bool) -> None:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2] if torn else data)
        f.flush()
        if torn:
            _die()
    os.replace(tmp, path)


def train(workdir: str, kill_step: int = -1, phase: str = "", resume: bool = False,
          n_steps: int = N_STEPS) -> None:
    """The training loop (see the module docstring)."""
    import torch
    from torch import nn

    import replay.recorder as recorder_mod
    from replay.recorder import RunRecorder
    from stability.monitor.monitor import Monitor
    from stability.outputs.events import EventLog

    torch.set_num_threads(1)
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    ckpt = wd / "ckpt.pt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log = EventLog(wd / "events.jsonl", fsync="never")
    mon = Monitor(CONFIG, event_log=log)
    mon.declare_family("grad_norm", ["l0", "l2", "l4"])
    start = 0
    if resume and ckpt.exists():
        payload = torch.load(ckpt, weights_only=False)
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["opt"])
        mon.load_state_dict(json.loads(payload["monitor"]))
        start = int(payload["step"]) + 1
    dec_fd = os.open(wd / "decisions.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if resume:
        _append(dec_fd, {"resume_from": start})
        log.info(start, "resumed")
    if phase == "part_write":
        real = recorder_mod.pq.write_table

        def torn_write(table: Any, where: Any, **kw: Any) -> None:
            if int(table.column("step")[-1].as_py()) >= kill_step:
                real(table, where, **kw)
                size = os.path.getsize(where)
                with open(where, "r+b") as f:
                    f.truncate(size // 2)
                _die()
            real(table, where, **kw)

        recorder_mod.pq.write_table = torn_write
    rec = RunRecorder(wd / "run", part_steps=PART_STEPS)
    layers = [model[0], model[2], model[4]]
    for s in range(start, n_steps):
        x, y = _batch(s)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        norms = np.array([float(torch.linalg.vector_norm(torch.cat(
            [p.grad.reshape(-1) for p in m.parameters()]))) for m in layers])
        gn = float(np.sqrt(np.sum(norms ** 2)))
        lv = float(loss.detach())
        metrics = {"loss": lv, "grad_norm": gn, "lr": 0.05}
        rec.log(s, {**metrics, **{f"grad_norm/l{2 * i}": float(v) for i, v in enumerate(norms)}})
        if s == kill_step and phase == "before_observe":
            _die()
        d = mon.observe(s, metrics, families={"grad_norm": norms})
        c = d.control
        _append(dec_fd, {"step": d.step, "loss": lv, "alarms": [a.to_dict() for a in d.alarms],
                         "interventions": [iv.to_dict() for iv in d.interventions],
                         "control": c.to_dict(), "skipped": list(d.skipped)})
        if s == kill_step and phase == "after_observe":
            _die()
        for g in opt.param_groups:
            g["lr"] = 0.05 * float(c.lr_factor)
        if c.clip_norm is not None and math.isfinite(c.clip_norm):
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip_norm)
        if not c.skip_step and math.isfinite(lv):
            opt.step()
        if s % CKPT_EVERY == 0:
            payload = {"model": model.state_dict(), "opt": opt.state_dict(), "step": s,
                       "monitor": json.dumps(mon.state_dict(), allow_nan=False)}
            _save_ckpt(ckpt, payload, torn=(s == kill_step and phase == "ckpt_write"))
        if s == kill_step and phase == "torn_event":
            os.write(log._fd, b'{"type":"alarm","step":')  # simulate a torn write
            _die()
    rec.close()
    log.close()
    os.close(dec_fd)
