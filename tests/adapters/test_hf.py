"""StabilityTrainerCallback with a real HF Trainer on CPU, a tiny GPT-2 built from a config."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stability.adapters.hf import StabilityTrainerCallback  # noqa: E402
from stability.types import Control, Decision  # noqa: E402


class _Scripted:
    def __init__(self, script):
        self.script = script
        self.seen = []
        self.metrics = []

    def observe(self, step, metrics=None, families=None):
        self.seen.append(step)
        self.metrics.append(dict(metrics or {}))
        return Decision(step, control=self.script.get(step, Control()))

    def state_dict(self):
        return {"version": 1}


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 32, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(tmp_path, cb, steps: int = 12, **kw):
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, eval_strategy="steps", eval_steps=5, **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                eval_dataset=_Data(16), callbacks=[cb])


def test_hf_callback_acts(tmp_path) -> None:
    mon = _Scripted({3: Control(skip_step=True), 5: Control(lr_factor=0.5),
                     8: Control(stop=True, stop_reason="scripted")})
    cb = StabilityTrainerCallback(mon, checkpoint_every=0)
    tr = _trainer(tmp_path, cb)
    weights = []
    orig = tr.optimizer_step if hasattr(tr, "optimizer_step") else None
    del orig

    class Rec(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            weights.append(model.transformer.wte.weight.detach().clone())

    tr.add_callback(Rec())
    tr.train()
    assert mon.seen == list(range(9))
    assert cb.stopped is not None and tr.state.global_step == 9
    assert torch.equal(weights[3], weights[4]) and not torch.equal(weights[2], weights[3])
    m0 = mon.metrics[0]
    assert m0["loss"] > 0 and m0["grad_norm"] > 0 and "lr" in m0
    assert any("val_loss" in m for m in mon.metrics)  # eval at step 5 fed to the next step
    # pre-clip norm measured by the callback equals the Trainer's own (logged) pre-clip norm
    assert cb.last_logged_grad_norm is not None
    assert tr.args.max_grad_norm == 0.0 and cb.guard.clip_norm == 1.0


def test_hf_callback_real_monitor(tmp_path) -> None:
    from stability.monitor import Monitor

    cb = StabilityTrainerCallback(Monitor("finetune"), checkpoint_every=5)
    tr = _trainer(tmp_path, cb, steps=15)
    tr.train()
    assert cb.guard is not None and cb.guard.step_count == 15
    assert cb.state_dict()["monitor"]["version"] >= 1
