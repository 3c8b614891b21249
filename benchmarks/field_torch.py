"""Field matrix, plain PyTorch: one cell = precision x fault x resume, really trained on CPU.

A tiny MLP regressor (16 -> 64 -> 64 -> 1, AdamW 1e-2, warm-up + cosine ``LambdaLR``, batch 64) is
trained for :data:`STEPS` steps, the loop written the way the README shows it (``guard.batches``,
``scaler.scale(loss).backward()``, ``guard.step(loss)``, ``guard.metrics()`` logged every
:data:`LOG_EVERY` steps), with

* precision ``fp32``; ``fp16`` (``torch.autocast("cpu", float16)`` + ``torch.amp.GradScaler``);
  ``bf16`` (``torch.autocast("cpu", bfloat16)``, no scaler);
* fault ``clean``; ``lr_x50`` (the schedule returns 50x from :data:`FAULT_STEP` on, to the end);
  ``nan_weight`` (one weight set to NaN at :data:`FAULT_STEP`); ``grad_explosion`` (gradients
  x1e4 for 3 steps from :data:`FAULT_STEP`);
* resume ``False``, or ``True``: at :data:`RESUME_STEP` everything is saved (``torch.save`` of
  model / optimizer / scheduler / scaler, ``json`` of ``guard.state_dict()``), every object is
  thrown away and rebuilt fresh (as in a new process) and training resumes from the files.

:func:`run_cell` returns the row of the field matrix (see its docstring).  Used by
``tests/adapters/test_torch_field.py`` and printed by ``benchmarks/bench_field.py``.
"""

from __future__ import annotations

import io
import json
import math
import statistics
import time
from typing import Any

import torch

from stability.adapters.interventions import TrainingStopped
from stability.adapters.torch import TorchGuard
from stability.adapters.torch_ops.amp import autocast_dtype
from stability.monitor.monitor import Monitor
from stability.outputs.feedback import ACTING

PRECISIONS = ("fp32", "fp16", "bf16")
FAULTS = ("clean", "lr_x50", "nan_weight", "grad_explosion")
STEPS = 150
FAULT_STEP = 90
RESUME_STEP = 70
CHECKPOINT_EVERY = 25
LOG_EVERY = 10
BATCH = 64
LR = 1e-2
LR_FLOOR = 0.02
PRESET = "small"


def _batch(seed: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i``: a pure function of ``(seed, i)`` (rewindable data)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    x = torch.randn(BATCH, 16, generator=g)
    return x, _teacher(x) + 0.05 * torch.randn(BATCH, 1, generator=g)


_W = torch.Generator().manual_seed(12345)
_TEACHER = torch.randn(16, 1, generator=_W) / 4.0


def _teacher(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ _TEACHER) * 2.0 + 0.3 * x[:, :1] * x[:, 1:2]


_VAL = _batch(10**6, 0)[0].repeat(8, 1) * 1.0
_VAL = (_VAL, _teacher(_VAL))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 1))


def _schedule(fault: str) -> Any:
    warm = STEPS // 10

    def lam(s: int) -> float:
        f = (s + 1) / warm if s < warm else LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (
            1 + math.cos(math.pi * (s - warm) / max(1, STEPS - warm)))
        if fault == "lr_x50" and s >= FAULT_STEP:
            f *= 50.0
        return f
    return lam


def _val_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(_VAL[0]), _VAL[1]))


class _Objects:
    """Everything a training script builds (fresh ones on resume)."""

    def __init__(self, precision: str, fault: str, seed: int, guarded: bool) -> None:
        self.model = _model(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule(fault))
        self.scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
        self.monitor = Monitor(PRESET, alert_sinks=[]) if guarded else None
        self.guard = TorchGuard(self.model, self.opt, self.sched, self.monitor,
                                scaler=self.scaler, checkpoint_every=CHECKPOINT_EVERY,
                                raise_on_stop=True, log_interventions=False) if guarded else None


def _user_args(o: _Objects) -> dict[str, Any]:
    g = o.opt.param_groups[0]
    out = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in g.items()
           if k not in ("params", "lr")}
    out["lr_is_schedule"] = math.isclose(g["lr"], o.sched.get_last_lr()[0], rel_tol=1e-12)
    if o.scaler is not None:
        out["scaler"] = (o.scaler.get_growth_factor(), o.scaler.get_backoff_factor(),
                         o.scaler.get_growth_interval())
    return out


def _save(o: _Objects) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": o.model.state_dict(), "opt": o.opt.state_dict(),
                "sched": o.sched.state_dict(),
                "scaler": None if o.scaler is None else o.scaler.state_dict(),
                "guard": None if o.guard is None else json.dumps(o.guard.state_dict())}, buf)
    return buf.getvalue()


def _load(o: _Objects, blob: bytes) -> None:
    sd = torch.load(io.BytesIO(blob), weights_only=True)
    o.model.load_state_dict(sd["model"])
    o.opt.load_state_dict(sd["opt"])
    o.sched.load_state_dict(sd["sched"])
    if o.scaler is not None:
        o.scaler.load_state_dict(sd["scaler"])
    if o.guard is not None:
        o.guard.load_state_dict(json.loads(sd["guard"]))


def _train(precision: str, fault: str, resume: bool, seed: int, guarded: bool) -> dict[str, Any]:
    dtype = autocast_dtype(precision)
    o = _Objects(precision, fault, seed, guarded)
    initial_args = _user_args(o)
    log: list[dict[str, float]] = []
    decisions: list[tuple[int, tuple[str, ...]]] = []
    t_step: list[float] = []
    stopped, reason = False, ""
    it = 0
    resumed = not resume

    def positions() -> Any:
        if o.guard is not None:
            return o.guard.batches(STEPS, 3 * STEPS)
        return iter(range(STEPS))

    pos_iter = positions()
    while True:
        try:
            pos = next(pos_iter)
        except StopIteration:
            break
        if not resumed and it == RESUME_STEP:
            blob = _save(o)
            old_guard = o.guard
            if old_guard is not None:
                old_guard.detach()
            o = _Objects(precision, fault, seed, guarded)  # a new process
            _load(o, blob)
            resumed = True
            pos_iter = positions()
            continue  # the new iterator yields the position the old one was at
        if fault == "nan_weight" and it == FAULT_STEP:
            with torch.no_grad():
                o.model[2].weight[3, 5] = float("nan")
        x, y = _batch(seed, pos)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = torch.nn.functional.mse_loss(o.model(x).float(), y)
        (o.scaler.scale(loss) if o.scaler is not None else loss).backward()
        if fault == "grad_explosion" and FAULT_STEP <= it < FAULT_STEP + 3:
            with torch.no_grad():
                for p in o.model.parameters():
                    p.grad.mul_(1e4)
        t0 = time.perf_counter()
        try:
            if o.guard is not None:
                d = o.guard.step(loss)
                decisions.append((d.step, tuple(iv.type for iv in d.interventions)))
            else:
                if o.scaler is not None:
                    o.scaler.step(o.opt)
                    o.scaler.update()
                else:
                    o.opt.step()
                o.sched.step()
                o.opt.zero_grad(set_to_none=True)
        except TrainingStopped as e:
            stopped, reason = True, e.reason
            decisions.append((e.step, ("stop",)))
            break
        finally:
            t_step.append(time.perf_counter() - t0)
        if o.guard is not None and it % LOG_EVERY == 0:
            log.append(o.guard.metrics())
        it += 1
        if o.guard is None and pos + 1 >= STEPS:
            break
    final = _val_loss(o.model)
    args_after = _user_args(o)
    overflows = o.guard.amp_overflows if o.guard is not None else 0
    if o.guard is not None:
        o.guard.detach()
        args_after = _user_args(o)
    acting = sum(1 for _, ivs in decisions for t in ivs if t in ACTING)
    return {"final_loss": final, "stopped": stopped, "stop_reason": reason,
            "acting_interventions": acting, "decisions": decisions, "log": log,
            "step_s": statistics.median(t_step) if t_step else math.nan,
            "args_unchanged": args_after == initial_args, "iterations": it,
            "amp_overflows": overflows}


_CLEAN_CACHE: dict[tuple[str, int], dict[str, Any]] = {}


def unguarded(precision: str, fault: str, seed: int = 0) -> dict[str, Any]:
    """The cell without any guard: what the fault does to an unprotected run."""
    return _train(precision, fault, False, seed, guarded=False)


def clean_reference(precision: str, seed: int = 0) -> dict[str, Any]:
    """The clean run of ``precision`` without any guard (cached per process)."""
    key = (precision, seed)
    if key not in _CLEAN_CACHE:
        _CLEAN_CACHE[key] = _train(precision, "clean", False, seed, guarded=False)
    return _CLEAN_CACHE[key]


def run_cell(precision: str, fault: str, resume: bool, seed: int = 0) -> dict[str, Any]:
    """Train one cell of the field matrix; returns its row.

    Keys: ``final_loss`` (held-out MSE), ``clean_final_loss`` (same precision and seed, clean,
    no guard), ``acting_interventions``, ``stopped``, ``stop_reason``, ``overhead_ms`` (median
    ``guard.step`` time minus the median time of the bare optimizer / scaler / scheduler calls
    of the unguarded clean run), ``log_has_stability_keys`` (the logged ``guard.metrics()``
    dicts carry ``stability/*`` keys), ``args_unchanged`` (optimizer hyperparameters, LR =
    schedule value and scaler settings as before the run), plus ``decisions`` (per step: step
    and intervention types), ``iterations`` and ``amp_overflows`` (scaler overflow steps).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}; got {fault!r}")
    torch.set_num_threads(1)
    ref = clean_reference(precision, seed)
    row = _train(precision, fault, resume, seed, guarded=True)
    row["clean_final_loss"] = ref["final_loss"]
    row["overhead_ms"] = 1e3 * (row.pop("step_s") - ref["step_s"])
    log = row.pop("log")
    row["log_has_stability_keys"] = bool(log) and all(
        any(k.startswith("stability/") for k in m) for m in log)
    row["precision"], row["fault"], row["resume"], row["trainer"] = (
        precision, fault, resume, "torch")
    return row


if __name__ == "__main__":  # pragma: no cover - manual check
    import sys

    p, f, r = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    res = run_cell(p, f, r)
    res.pop("decisions")
    print(res)
