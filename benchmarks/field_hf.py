"""Field matrix for the HF Transformers adapter: real ``Trainer`` runs on CPU with injected faults.

One cell = precision x fault x resume::

    python benchmarks/field_hf.py                 # prints the whole matrix (fp32, fp16, bf16)
    python benchmarks/field_hf.py bf16 nan_weight 1

Precisions: ``fp32``; ``bf16`` (``TrainingArguments(bf16=True)``: CPU bf16 autocast);
``fp16``: ``TrainingArguments(fp16=True)`` alone trains in fp32 on CPU (accelerate only creates
fp16 autocast and a ``GradScaler`` on GPUs), so the harness also gives the Trainer's accelerator
a CPU ``torch.amp.GradScaler`` and turns native AMP on before ``train()`` -- the code path HF
takes on a GPU (fp16 autocast, scaled loss, scaler-skipped overflow steps).

Faults (from step ``FAULT_AT``): ``clean``; ``lr50`` (the LR schedule multiplies by 50 from then
on, persistently); ``nan_weight`` (one weight set to NaN); ``grad_explosion`` (gradients x1e4 for
3 steps). ``resume=True`` stops the run at step ``RESUME_AT`` right after HF saved
``checkpoint-RESUME_AT`` and finishes it in a new Trainer with a new callback and a new monitor
(``train(resume_from_checkpoint=...)``).

:func:`run_cell` returns final_loss, clean_final_loss, acting_interventions, stopped,
stop_reason, overhead_ms, log_has_stability_keys, args_unchanged.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from field_task import (
    BATCH,
    FAULT_AT,
    FAULTS,
    PRECISIONS,
    PRESET,
    RESUME_AT,
    STEPS,
    explode_hooks,
    held_out_loss,
    lr_lambda,
    make_net,
    poison,
    teacher_data,
)

from stability.adapters.hf import StabilityTrainerCallback
from stability.monitor.monitor import Monitor

SAVE_STEPS = 10


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = teacher_data(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = make_net(seed)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        logits = self.net(x)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.float(), labels)
        return out


class Fault(transformers.TrainerCallback):  # type: ignore[misc]
    """Injects the cell's fault at HF ``global_step`` FAULT_AT (iterations, never rewound)."""

    def __init__(self, kind: str, model: Net) -> None:
        self.kind = kind
        self.model = model
        self.explode = False
        if kind == "grad_explosion":
            explode_hooks(model, lambda: self.explode)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        s = state.global_step
        if self.kind == "nan_weight" and s == FAULT_AT:
            poison(self.model.net)
        self.explode = self.kind == "grad_explosion" and FAULT_AT <= s < FAULT_AT + 3


class StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


@dataclass
class Phase:
    trainer: Any
    callback: StabilityTrainerCallback
    model: Net


@dataclass
class FieldRun:
    """Everything one cell produced (for tests)."""

    phases: list[Phase] = field(default_factory=list)
    out_dir: str = ""
    user_args: dict[str, Any] = field(default_factory=dict)
    final_loss: float = math.nan
    wall_s: float = 0.0

    @property
    def trainer(self) -> Any:
        return self.phases[-1].trainer

    @property
    def callback(self) -> StabilityTrainerCallback:
        return self.phases[-1].callback

    def acting(self) -> list[Any]:
        out = []
        for ph in self.phases:
            g = ph.callback.guard
            out += [i for i in (g.interventions if g else []) if i.type != "alert"]
        return out


def make_args(out_dir: str, precision: str, seed: int) -> Any:
    kw: dict[str, Any] = {}
    if precision == "bf16":
        kw["bf16"] = True
    elif precision == "fp16":
        kw["fp16"] = True
    return transformers.TrainingArguments(
        out_dir, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=5, save_strategy="steps",
        save_steps=SAVE_STEPS, save_total_limit=3, report_to=[], use_cpu=True, disable_tqdm=True,
        seed=seed, data_seed=seed, eval_strategy="no", dataloader_num_workers=0, **kw)


def _trainer(out_dir: str, precision: str, fault: str, seed: int, stop_at: int | None,
             monitor: Any = None, init_scale: float = 2.0**16, guarded: bool = True) -> Phase:
    model = Net(seed)
    args = make_args(out_dir, precision, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(fault))
    cb = StabilityTrainerCallback(monitor if monitor is not None else Monitor(PRESET))
    cbs: list[Any] = [Fault(fault, model)] + ([cb] if guarded else [])
    if stop_at is not None:
        cbs.append(StopAt(stop_at))
    tr = transformers.Trainer(model=model, args=args, train_dataset=Data(STEPS * BATCH, seed),
                              optimizers=(opt, sched), callbacks=cbs)
    tr.remove_callback(transformers.trainer_callback.PrinterCallback)
    if precision == "fp16":  # what accelerate does on a GPU (see the module docstring)
        tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        tr.accelerator.native_amp = True
    return Phase(tr, cb, model)


def run(precision: str, fault: str, resume: bool, seed: int = 0,
        out_dir: str | None = None, init_scale: float = 2.0**16) -> FieldRun:
    """Train one cell; returns the :class:`FieldRun`.

    ``init_scale`` is the fp16 GradScaler's start scale (``2**22`` makes the first steps
    overflow, as the default ``2**16`` does on larger GPU models).
    """
    if precision not in PRECISIONS or fault not in FAULTS:
        raise ValueError(f"precision must be one of {PRECISIONS} and fault one of {FAULTS}; "
                         f"got {precision!r}, {fault!r}.")
    torch.set_num_threads(1)
    own = out_dir is None
    tmp = tempfile.TemporaryDirectory(prefix="field_hf_") if own else None
    d = tmp.name if tmp is not None else str(out_dir)
    res = FieldRun(out_dir=d)
    t0 = time.perf_counter()
    try:
        ph = _trainer(d, precision, fault, seed, RESUME_AT if resume else None,
                      init_scale=init_scale)
        res.user_args = copy.deepcopy(ph.trainer.args.to_dict())
        ph.trainer.train()
        res.phases.append(ph)
        if resume and ph.callback.stopped is None:
            ph2 = _trainer(d, precision, fault, seed, None, init_scale=init_scale)
            ph2.trainer.train(resume_from_checkpoint=os.path.join(d, f"checkpoint-{RESUME_AT}"))
            res.phases.append(ph2)
        res.final_loss = held_out_loss(res.phases[-1].model.net, seed)
        res.wall_s = time.perf_counter() - t0
        res.user_args["_saved_equal"] = _saved_args_equal(d, res.user_args)
        res.user_args["_live_equal"] = all(
            p.trainer.args.to_dict() == {k: v for k, v in res.user_args.items()
                                         if not k.startswith("_")} for p in res.phases)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return res


def _saved_args_equal(d: str, user: dict[str, Any]) -> bool:
    ref = {k: v for k, v in user.items() if not k.startswith("_")}
    found = 0
    for name in sorted(os.listdir(d)):
        f = os.path.join(d, name, "training_args.bin")
        if os.path.exists(f):
            found += 1
            if torch.load(f, weights_only=False).to_dict() != ref:
                return False
    return found > 0


_CLEAN: dict[tuple[str, int], float] = {}


def clean_final_loss(precision: str, seed: int = 0) -> float:
    """Final held-out loss of the clean, uninterrupted run (cached per process)."""
    key = (precision, seed)
    if key not in _CLEAN:
        _CLEAN[key] = run(precision, "clean", False, seed).final_loss
    return _CLEAN[key]


def summarize(res: FieldRun, clean: float) -> dict[str, Any]:
    cb = res.callback
    steps = sum(p.callback.overhead_steps for p in res.phases)
    over = sum(p.callback.overhead_s for p in res.phases)
    hist = [h for p in res.phases for h in p.trainer.state.log_history]
    stopped = next((p.callback.stopped for p in res.phases if p.callback.stopped), None)
    return {
        "final_loss": res.final_loss,
        "clean_final_loss": clean,
        "acting_interventions": len(res.acting()),
        "stopped": stopped is not None,
        "stop_reason": None if stopped is None else stopped.reason,
        "overhead_ms": 1e3 * over / max(1, steps),
        "log_has_stability_keys": any("stability/lr_factor" in h for h in hist),
        "args_unchanged": bool(res.user_args.get("_saved_equal"))
        and bool(res.user_args.get("_live_equal")),
        "rollbacks": cb.guard.rollbacks if cb.guard else 0,
        "wall_s": res.wall_s,
        "decisions": [(i.step, i.type) for ph in res.phases
                      for i in (ph.callback.guard.interventions if ph.callback.guard else [])],
        "amp_overflows": sum(p.callback.guard.amp_overflows for p in res.phases
                             if p.callback.guard),
    }


def unguarded(precision: str, fault: str, seed: int = 0) -> dict[str, Any]:
    """The cell without the callback: what the fault does to an unprotected run."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="field_hf_") as d:
        ph = _trainer(d, precision, fault, seed, None, guarded=False)
        ph.trainer.train()
        return {"final_loss": held_out_loss(ph.model.net, seed)}


def run_cell(precision: str, fault: str, resume: bool, seed: int = 0) -> dict[str, Any]:
    """One field-matrix cell (see the module docstring for the keys)."""
    clean = clean_final_loss(precision, seed)
    if fault == "clean" and not resume:
        res = run(precision, fault, resume, seed)
        return summarize(res, clean)
    return summarize(run(precision, fault, resume, seed), clean)


def main(argv: list[str]) -> None:
    if len(argv) == 3:
        print(run_cell(argv[0], argv[1], argv[2] not in ("0", "false", "False")))
        return
    print(f"{'precision':9} {'fault':15} {'resume':6} {'final':>7} {'clean':>7} {'acts':>4} "
          f"{'stop':24} {'ms/step':>7} keys args")
    for prec in PRECISIONS:
        for fault in FAULTS:
            for resume in (False, True):
                r = run_cell(prec, fault, resume)
                print(f"{prec:9} {fault:15} {resume!s:6} {r['final_loss']:7.3f} "
                      f"{r['clean_final_loss']:7.3f} {r['acting_interventions']:4d} "
                      f"{(r['stop_reason'] or '-')[:24]:24} {r['overhead_ms']:7.2f} "
                      f"{r['log_has_stability_keys']!s:4} {r['args_unchanged']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
