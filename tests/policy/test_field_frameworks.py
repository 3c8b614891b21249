"""Field scenarios of issue 24 in the HF Trainer and Lightning (plain torch: test_invariants.py).

A small MLP learns a fixed random teacher (``benchmarks/field_task.py``) with AdamW and a real
warm-up + cosine ``LambdaLR``; a window of 20 corrupt batches (inputs x10, random labels) hits
trainer steps ``WINDOW``.  The guarded run must end within 2 % of the clean run (held-out loss)
and never worse than the unguarded one.  Each run is a few hundred real optimizer steps on CPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "field_task.py"
_spec = importlib.util.spec_from_file_location("field_task", _PATH)
assert _spec is not None and _spec.loader is not None
field_task = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("field_task", field_task)
_spec.loader.exec_module(field_task)

from stability import Monitor  # noqa: E402

STEPS = 600
WINDOW = (350, 370)  # 20 bad batches (as in test_invariants.py)
BATCH = 16
torch.set_num_threads(1)


def lr_lambda(s: int) -> float:
    import math
    return min(1.0, (s + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / STEPS)))


class Net(torch.nn.Module):
    """The field MLP; corrupts its own batch while ``bad`` is set (the data of that step)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = field_task.make_net(seed)
        self.bad = False

    def forward(self, x: Any, labels: Any = None) -> Any:
        if self.bad and self.training:  # a corrupt batch: scaled inputs, random labels
            # (training forwards only: the fault is in the data of the step, so the guard's
            # canary -- stored clean batches evaluated in eval() mode -- must not see it)
            g = torch.Generator().manual_seed(int(x.sum().abs() * 1000) % 2**31)
            x = x * 10
            labels = torch.randint(0, field_task.CLASSES, labels.shape, generator=g)
        out = self.net(x)
        if labels is None:
            return {"logits": out}
        return {"loss": torch.nn.functional.cross_entropy(out, labels), "logits": out}


def held_out(model: Net) -> float:
    return float(field_task.held_out_loss(model.net, 0))


# ------------------------------------------------------------------ HF Trainer
def _hf_run(fault: bool, guarded: bool) -> tuple[float, Any]:
    transformers = pytest.importorskip("transformers")
    from stability.adapters.hf import StabilityTrainerCallback

    class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.x, self.y = field_task.teacher_data(STEPS * BATCH, 0)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": self.x[i], "labels": self.y[i]}

    model = Net(0)

    class Window(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model.bad = fault and WINDOW[0] <= state.global_step < WINDOW[1]

    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(
            d, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
            weight_decay=0.0, max_grad_norm=1.0, logging_steps=50, save_strategy="no",
            report_to=[], use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
            dataloader_num_workers=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        cb = StabilityTrainerCallback(Monitor("small"), checkpoint_dir=os.path.join(d, "ck"),
                                      checkpoint_every=25) if guarded else None
        tr = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                                  optimizers=(opt, sched),
                                  callbacks=[Window()] + ([cb] if cb is not None else []))
        tr.remove_callback(transformers.trainer_callback.PrinterCallback)
        tr.train()
    model.bad = False
    return held_out(model), cb


# ------------------------------------------------------------------ Lightning
def _pl_run(fault: bool, guarded: bool) -> tuple[float, Any]:
    L = pytest.importorskip("lightning")
    from stability.adapters.lightning import StabilityCallback

    model = Net(0)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            model.bad = fault and WINDOW[0] <= self.global_step < WINDOW[1]
            return self.model(batch[0], batch[1])["loss"]

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x, y = field_task.teacher_data(STEPS * BATCH, 0)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH,
                                     shuffle=True, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        cb = StabilityCallback(Monitor("small"), checkpoint_dir=os.path.join(d, "ck"),
                               checkpoint_every=25) if guarded else None
        torch.manual_seed(0)
        tr = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, gradient_clip_val=1.0,
                       callbacks=[cb] if cb is not None else [], default_root_dir=d)
        tr.fit(Module(), dl)
    model.bad = False
    return held_out(model), cb


@pytest.mark.parametrize("runner", [
    # HF: the x1000 window (CE ~0.1 -> ~100) is ~1000 sigma for loss_spike_linear (linear
    # space; the log-space bindings score 6.5 / 8.0 here: ~1 log unit of noise near the floor):
    # skipped at 350-353 and 356, then adapted, then undone by one rollback at 390 (to 349).
    # HF's lost steps come out of max_steps (no batch left in this one-epoch dataset to give
    # them back); the run still ends within 2 % of clean
    pytest.param(_hf_run, id="hf"),
    # Lightning: undone by one rollback at 390 (to 349); the 41 lost steps are given back to
    # max_steps (extend_max_steps) -- without them it ended 2.7 % above clean, exactly where a
    # *fault-free* run rolled back 390 -> 349 ends (0.0973): the cost of the lost steps
    pytest.param(_pl_run, id="lightning"),
])
def test_a_20_batch_bad_window_ends_within_2pct_of_clean(runner: Any, caplog: Any) -> None:
    caplog.set_level(logging.WARNING)
    c, _ = runner(False, False)
    a, _ = runner(True, False)
    b, cb = runner(True, True)
    assert cb.guard is not None and cb.guard.stopped is None
    assert b <= 1.02 * c, (b, a, c)
    assert b <= a, (b, a, c)
