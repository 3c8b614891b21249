"""The trainer logs of guarded runs, and what ``replay`` / ``watch`` make of them.

A guarded run writes its own ``stability/*`` feedback into the trainer's logs; those logs are
then what a user replays, watches or reports on.  This module trains the field task
(``field_task.py``) in each stack with its guard and writes the logs a user would have:

===========  ====================================================================
``hf``       ``checkpoint-N/trainer_state.json`` and the TensorBoard event file
``hf_fp16``  the same in fp16 with a GradScaler whose first steps overflow (scaler-skipped)
``lightning``  ``CSVLogger``'s ``metrics.csv`` and ``TensorBoardLogger``'s event file
``torch``    one JSONL line per step: ``{"step", "loss", **guard.metrics()}``
===========  ====================================================================

:func:`judge_logs` replays every log (``replay_run``) and watches it once (``Watcher``) with
the default preset and counts alarms and acting interventions: a clean run's own logs must give
none.  Used by ``tests/field/test_own_logs.py`` and ``benchmarks/bench_field.py``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from field_task import (
    FAULT_AT,
    PRESET,
    STEPS,
    explode_hooks,
    lr_lambda,
    make_net,
    poison,
    teacher_data,
)

from stability.monitor.monitor import Monitor

__all__ = ["STACKS", "hf_fp16_logs", "hf_logs", "judge_logs", "lightning_logs", "torch_logs"]

STACKS = ("torch", "hf", "lightning")
BATCH = 16
#: the alarms the live HF monitor raised, ``[[log step, kind, signal], ...]`` (``hf_logs``)
LIVE_ALARMS = "live_alarms.json"


def live_alarms(d: str) -> list[tuple[int, str, str]]:
    """The sorted ``(log step, kind, signal)`` alarms of the live run ``hf_logs`` wrote in
    ``d``."""
    with open(os.path.join(d, LIVE_ALARMS)) as fh:
        return sorted((int(s), str(k), str(g)) for s, k, g in json.load(fh))


def torch_logs(d: str, fault: str = "clean", seed: int = 0) -> dict[str, str]:
    """Plain torch: ``attach`` + ``guard.step``; ``guard.metrics()`` appended to a JSONL file."""
    from stability.adapters.interventions import TrainingStopped
    from stability.torch import attach

    torch.manual_seed(seed)
    net = make_net(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(fault))
    guard = attach(net, opt, sched, Monitor(PRESET), clip_norm=1.0, log_interventions=False)
    explode = [False]
    if fault == "grad_explosion":
        explode_hooks(net, lambda: explode[0])
    x, y = teacher_data(STEPS * BATCH, seed)
    path = os.path.join(d, "metrics.jsonl")
    with open(path, "w") as fh:
        for i in range(STEPS):
            if fault == "nan_weight" and i == FAULT_AT:
                poison(net)
            explode[0] = fault == "grad_explosion" and FAULT_AT <= i < FAULT_AT + 3
            xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            loss = torch.nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            try:
                guard.step(loss)
            except TrainingStopped:
                break
            finally:
                row = {"step": i, "loss": loss.item(), **guard.metrics()}
                fh.write(json.dumps(row) + "\n")
    guard.detach()
    return {"jsonl": path}


def hf_logs(d: str, fault: str = "clean", seed: int = 0,
            precision: str = "fp32") -> dict[str, str]:
    """HF ``Trainer`` with the callback, ``report_to=["tensorboard"]``.

    ``logging_nan_inf_filter=False``: HF's default replaces a NaN/inf loss by the mean of the
    previous ones before logging it, so a faulty run's logs would not show the fault at all.
    ``precision="fp16"``: fp16 autocast with a CPU ``GradScaler`` starting at ``2**22`` (what
    accelerate does on a GPU; the first steps overflow and are skipped by the scaler), logged
    every step so the skipped steps are in the log.
    """
    import transformers
    from field_hf import Data, Fault, Net

    from stability.adapters.hf import StabilityTrainerCallback

    torch.manual_seed(seed)
    model = Net(seed)
    args = transformers.TrainingArguments(
        d, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1 if precision == "fp16" else 5,
        save_strategy="steps", fp16=precision == "fp16",
        save_steps=STEPS, report_to=["tensorboard"], logging_nan_inf_filter=False,
        use_cpu=True, disable_tqdm=True, seed=seed, data_seed=seed, dataloader_num_workers=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(fault))
    mon = Monitor(PRESET)
    live: list[Any] = []
    mon.on_alarm(live.append)
    cb = StabilityTrainerCallback(mon)
    tr = transformers.Trainer(model=model, args=args, train_dataset=Data(STEPS * BATCH, seed),
                              optimizers=(opt, sched), callbacks=[Fault(fault, model), cb])
    tr.remove_callback(transformers.trainer_callback.PrinterCallback)
    if precision == "fp16":
        tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
        tr.accelerator.native_amp = True
    tr.train()
    with open(os.path.join(d, LIVE_ALARMS), "w") as fh:  # HF's step = the guard's + 1
        json.dump([[a.step + 1, a.kind, a.signal] for a in live], fh)
    states = sorted(glob.glob(os.path.join(d, "checkpoint-*", "trainer_state.json")))
    if not states:  # stopped before the save: HF's state of the last step
        tr.state.save_to_json(os.path.join(d, "trainer_state.json"))
        states = [os.path.join(d, "trainer_state.json")]
    return {"trainer_state": states[-1], "tensorboard": _tb_dir(d)}


def lightning_logs(d: str, fault: str = "clean", seed: int = 0) -> dict[str, str]:
    """Lightning with the callback, a ``CSVLogger`` and a ``TensorBoardLogger``."""
    import lightning as L
    from field_lightning import Fault, LitNet
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from stability.adapters.lightning import StabilityCallback

    class LoggingNet(LitNet):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    module = LoggingNet(fault, seed)
    cb = StabilityCallback(Monitor(PRESET), checkpoint_every=0)
    x, y = teacher_data(STEPS * BATCH, seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = L.Trainer(max_steps=STEPS, callbacks=[Fault(fault, module), cb],
                       gradient_clip_val=1.0, accelerator="cpu", log_every_n_steps=5,
                       logger=[CSVLogger(d, name="csv"), TensorBoardLogger(d, name="tb")],
                       enable_progress_bar=False, enable_model_summary=False,
                       enable_checkpointing=False, default_root_dir=d, deterministic=True)
        tr.fit(module, loader)
    csv = glob.glob(os.path.join(d, "csv", "version_*", "metrics.csv"))[0]
    return {"csv": csv, "tensorboard": _tb_dir(d)}


def _tb_dir(d: str) -> str:
    files = glob.glob(os.path.join(d, "**", "events.out.tfevents.*"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {d}")
    return os.path.dirname(sorted(files)[0])


def hf_fp16_logs(d: str, fault: str = "clean", seed: int = 0) -> dict[str, str]:
    """:func:`hf_logs` in fp16 with a GradScaler whose first steps overflow."""
    return hf_logs(d, fault, seed, precision="fp16")


MAKERS = {"torch": torch_logs, "hf": hf_logs, "hf_fp16": hf_fp16_logs,
          "lightning": lightning_logs}


def judge_logs(logs: dict[str, str], config: Any = None) -> dict[str, dict[str, Any]]:
    """``{log: {"steps", "watch_steps", "replay_alarms", "replay_acting", "watch_alarms",
    "watch_acting", "replay_alarm_keys", "watch_alarm_keys"}}`` (the ``*_keys``: sorted
    ``(step, kind, signal)`` of every alarm).

    Every log is replayed (``replay.replay.replay_run``) and watched once
    (``replay.watch.Watcher``, no hooks, quiet) with ``config`` (default: the default preset).
    """
    from replay.replay import replay_run
    from replay.watch import Watcher
    from stability.outputs.feedback import is_acting

    out: dict[str, dict[str, Any]] = {}
    for name, path in logs.items():
        res = replay_run(path, config)
        w = Watcher([path], config, echo=None)
        decisions = w.poll() + w.flush()
        w.close()
        out[name] = {
            "steps": int(res.n_steps),
            "watch_steps": len(decisions),
            "replay_alarms": len(res.alarms),
            "replay_acting": sum(is_acting(i) for i in res.interventions),
            "watch_alarms": sum(len(dd.alarms) for dd in decisions),
            "watch_acting": sum(is_acting(i) for dd in decisions for i in dd.interventions),
            "replay_alarm_keys": sorted((int(a.step), a.kind, a.signal) for a in res.alarms),
            "watch_alarm_keys": sorted((int(dd.step), a.kind, a.signal)
                                       for dd in decisions for a in dd.alarms),
        }
    return out
