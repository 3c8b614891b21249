"""Field matrix for the Lightning adapter: real ``L.Trainer`` runs on CPU with injected faults.

One cell = precision x fault x resume::

    python benchmarks/field_lightning.py              # prints the whole matrix
    python benchmarks/field_lightning.py fp16 lr50 1

Precisions: ``fp32`` (``precision="32-true"``); ``bf16`` (``"bf16-mixed"``, CPU bf16 autocast);
``fp16``: ``precision="16-mixed"`` on CPU is silently turned into ``bf16-mixed`` by Lightning, so
the harness passes ``plugins=[MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))]``:
fp16 autocast and a real loss scaler on CPU (the code path Lightning takes on a GPU).

Faults, task and schedule: ``field_task.py`` (shared with ``field_hf.py``). ``resume=True`` stops
the run at step ``RESUME_AT`` (an epoch end: Lightning resumes plain dataloaders reliably only
there) and finishes it in a new Trainer, module, callback and monitor with
``fit(..., ckpt_path=<ModelCheckpoint file>)``.

:func:`run_cell` returns final_loss, clean_final_loss, acting_interventions, stopped,
stop_reason, overhead_ms (the guard: measuring, deciding, acting), io_ms (the callback's
checkpoint writes and ``log_dict`` calls, Lightning's own cost), log_has_stability_keys (read
from the CSVLogger's ``metrics.csv``),
args_unchanged (the Trainer's clipping, precision, accumulation and step settings, and the
optimizer's hyperparameters apart from the scheduled ``lr``).
"""

from __future__ import annotations

import csv
import glob
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

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

from stability.adapters.lightning import StabilityCallback
from stability.monitor.monitor import Monitor

EPOCH_STEPS = 10
CHECKPOINT_EVERY = 10


class LitNet(L.LightningModule):
    def __init__(self, fault: str, seed: int) -> None:
        super().__init__()
        self.net = make_net(seed)
        self.fault = fault

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.fault))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Fault(L.Callback):
    """Injects the cell's fault at ``trainer.global_step`` FAULT_AT (never rewound)."""

    def __init__(self, kind: str, module: LitNet) -> None:
        self.kind = kind
        self.explode = False
        if kind == "grad_explosion":
            explode_hooks(module.net, lambda: self.explode)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        s = trainer.global_step
        if self.kind == "nan_weight" and s == FAULT_AT:
            poison(pl_module.net)
        self.explode = self.kind == "grad_explosion" and FAULT_AT <= s < FAULT_AT + 3


def loader(seed: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    x, y = teacher_data(EPOCH_STEPS * BATCH, seed)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


@dataclass
class Phase:
    trainer: L.Trainer
    callback: StabilityCallback
    module: LitNet
    settings_before: dict[str, Any]


@dataclass
class FieldRun:
    """Everything one cell produced (for tests)."""

    phases: list[Phase] = field(default_factory=list)
    out_dir: str = ""
    final_loss: float = math.nan
    csv_rows: list[dict[str, str]] = field(default_factory=list)
    args_unchanged: bool = False
    wall_s: float = 0.0

    @property
    def trainer(self) -> L.Trainer:
        return self.phases[-1].trainer

    @property
    def callback(self) -> StabilityCallback:
        return self.phases[-1].callback

    def acting(self) -> list[Any]:
        out = []
        for ph in self.phases:
            g = ph.callback.guard
            out += [i for i in (g.interventions if g else []) if i.type != "alert"]
        return out


def settings(tr: L.Trainer) -> dict[str, Any]:
    """The user's Trainer settings that must come out of a run unchanged."""
    return {"gradient_clip_val": tr.gradient_clip_val,
            "gradient_clip_algorithm": tr.gradient_clip_algorithm,
            "accumulate_grad_batches": tr.accumulate_grad_batches,
            "precision": tr.precision, "max_steps": tr.max_steps}


def opt_settings(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters apart from the scheduled LR."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
            for g in opt.param_groups]


def _trainer(d: str, precision: str, fault: str, seed: int, max_steps: int,
             init_scale: float = 2.0**16, guarded: bool = True) -> Phase:
    module = LitNet(fault, seed)
    cb = StabilityCallback(Monitor(PRESET), checkpoint_every=CHECKPOINT_EVERY,
                           checkpoint_dir=os.path.join(d, "stability"))
    kw: dict[str, Any] = {}
    if precision == "fp16":  # what Lightning does on a GPU (see the module docstring)
        kw["plugins"] = [MixedPrecision("16-mixed", "cpu",
                                        scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]
    elif precision == "bf16":
        kw["precision"] = "bf16-mixed"
    ckpt = ModelCheckpoint(dirpath=os.path.join(d, "ckpt"), every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)
    cbs: list[Any] = [Fault(fault, module)] + ([cb] if guarded else []) + [ckpt]
    tr = L.Trainer(max_steps=max_steps, callbacks=cbs,
                   gradient_clip_val=1.0, accelerator="cpu", logger=CSVLogger(d, name="csv"),
                   log_every_n_steps=5, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, default_root_dir=d, deterministic=True, **kw)
    return Phase(tr, cb, module, settings(tr))


def run(precision: str, fault: str, resume: bool, seed: int = 0,
        out_dir: str | None = None, init_scale: float = 2.0**16) -> FieldRun:
    """Train one cell; returns the :class:`FieldRun`."""
    if precision not in PRECISIONS or fault not in FAULTS:
        raise ValueError(f"precision must be one of {PRECISIONS} and fault one of {FAULTS}; "
                         f"got {precision!r}, {fault!r}.")
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    tmp = tempfile.TemporaryDirectory(prefix="field_pl_") if out_dir is None else None
    d = tmp.name if tmp is not None else str(out_dir)
    res = FieldRun(out_dir=d)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ph = _trainer(d, precision, fault, seed, RESUME_AT if resume else STEPS, init_scale)
            ph.trainer.fit(ph.module, loader(seed))
            res.phases.append(ph)
            if resume and ph.callback.stopped is None:
                path = glob.glob(os.path.join(d, "ckpt", f"*step={RESUME_AT}.ckpt"))[0]
                ph2 = _trainer(d, precision, fault, seed, STEPS, init_scale)
                ph2.trainer.fit(ph2.module, loader(seed), ckpt_path=path)
                res.phases.append(ph2)
        res.final_loss = held_out_loss(res.phases[-1].module.net, seed)
        res.wall_s = time.perf_counter() - t0
        ref = opt_settings(LitNet(fault, seed).configure_optimizers()["optimizer"])
        res.args_unchanged = all(settings(p.trainer) == p.settings_before
                                 and opt_settings(p.trainer.optimizers[0]) == ref
                                 for p in res.phases)
        for f in sorted(glob.glob(os.path.join(d, "csv", "version_*", "metrics.csv"))):
            with open(f, newline="") as fh:
                res.csv_rows += list(csv.DictReader(fh))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return res


_CLEAN: dict[tuple[str, int], float] = {}


def clean_final_loss(precision: str, seed: int = 0) -> float:
    """Final held-out loss of the clean, uninterrupted run (cached per process)."""
    key = (precision, seed)
    if key not in _CLEAN:
        _CLEAN[key] = run(precision, "clean", False, seed).final_loss
    return _CLEAN[key]


def summarize(res: FieldRun, clean: float) -> dict[str, Any]:
    steps = sum(p.callback.overhead_steps for p in res.phases)
    over = sum(p.callback.overhead_s for p in res.phases)
    stopped = next((p.callback.stopped for p in res.phases if p.callback.stopped), None)
    g = res.callback.guard
    return {
        "final_loss": res.final_loss,
        "clean_final_loss": clean,
        "acting_interventions": len(res.acting()),
        "stopped": stopped is not None,
        "stop_reason": None if stopped is None else stopped.reason,
        "overhead_ms": 1e3 * over / max(1, steps),
        "io_ms": 1e3 * sum(p.callback.io_s for p in res.phases) / max(1, steps),
        "log_has_stability_keys": any(r.get("stability/lr_factor") not in (None, "")
                                      for r in res.csv_rows),
        "args_unchanged": res.args_unchanged,
        "rollbacks": g.rollbacks if g else 0,
        "wall_s": res.wall_s,
        "decisions": [(i.step, i.type) for ph in res.phases
                      for i in (ph.callback.guard.interventions if ph.callback.guard else [])],
        "amp_overflows": sum(p.callback.guard.amp_overflows for p in res.phases
                             if p.callback.guard),
    }


def unguarded(precision: str, fault: str, seed: int = 0) -> dict[str, Any]:
    """The cell without the callback: what the fault does to an unprotected run."""
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="field_pl_") as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ph = _trainer(d, precision, fault, seed, STEPS, guarded=False)
        ph.trainer.fit(ph.module, loader(seed))
        return {"final_loss": held_out_loss(ph.module.net, seed)}


def run_cell(precision: str, fault: str, resume: bool, seed: int = 0) -> dict[str, Any]:
    """One field-matrix cell (see the module docstring for the keys)."""
    return summarize(run(precision, fault, resume, seed), clean_final_loss(precision, seed))


def main(argv: list[str]) -> None:
    if len(argv) == 3:
        print(run_cell(argv[0], argv[1], argv[2] not in ("0", "false", "False")))
        return
    print(f"{'precision':9} {'fault':15} {'resume':6} {'final':>7} {'clean':>7} {'acts':>4} "
          f"{'stop':24} {'ms/step':>7} {'io_ms':>6} keys args")
    for prec in PRECISIONS:
        for fault in FAULTS:
            for resume in (False, True):
                r = run_cell(prec, fault, resume)
                print(f"{prec:9} {fault:15} {resume!s:6} {r['final_loss']:7.3f} "
                      f"{r['clean_final_loss']:7.3f} {r['acting_interventions']:4d} "
                      f"{(r['stop_reason'] or '-')[:24]:24} {r['overhead_ms']:7.2f} "
                      f"{r['io_ms']:6.2f} {r['log_has_stability_keys']!s:4} "
                      f"{r['args_unchanged']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
