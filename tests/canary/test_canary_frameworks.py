"""The canary set in the HF Trainer (on by default) and Lightning (``canary=K, canary_loss=fn``).

The field MLP of ``tests/policy/test_field_frameworks.py`` (a fixed random teacher, AdamW, real
warm-up + cosine ``LambdaLR``) trained by the real Trainers on CPU.  The data itself is corrupt
(the collate function shuffles the labels of every batch from batch ``BAD_FROM`` on: bad data to
the end, no validation set).  What must hold: the run stops with the healthy pre-fault weights in
the model and in anything the trainer saves afterwards; a clean run trains bit-identically with
and without the canary; the canary's state survives the trainer's checkpoint round trip.
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from stability import Monitor  # noqa: E402
from tests.policy.test_field_frameworks import BATCH, Net, field_task, held_out  # noqa: E402

STEPS = 400
BAD_FROM = 150  # batches collated from here on have shuffled labels
WINDOW = (200, 220)  # a stuck loader: one corrupt batch 20 times
torch.set_num_threads(1)
F = torch.nn.functional


class Collate:
    """Stacks a batch; with ``fault`` the labels are shuffled from the ``BAD_FROM``-th batch on
    (a broken data source: to the end of the run); with ``fault="stuck"`` batches ``WINDOW``
    are one corrupt batch (inputs x10, random labels) repeated: a stuck loader, memorised."""

    def __init__(self, fault: bool | str, as_dict: bool) -> None:
        self.fault, self.as_dict, self.n = fault, as_dict, 0

    def __call__(self, items: list[Any]) -> Any:
        x = torch.stack([it[0] for it in items])
        y = torch.stack([it[1] for it in items])
        if self.fault == "stuck" and WINDOW[0] <= self.n < WINDOW[1]:
            g = torch.Generator().manual_seed(5)
            x = torch.randn(x.shape, generator=g) * 10
            y = torch.randint(0, field_task.CLASSES, y.shape, generator=g)
        elif self.fault is True and self.n >= BAD_FROM:
            y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(self.n))]
        self.n += 1
        return {"x": x, "labels": y} if self.as_dict else (x, y)


class DropoutNet(Net):
    """The field MLP with input dropout (an evaluation could disturb its RNG stream)."""

    def forward(self, x: Any, labels: Any = None) -> Any:
        return super().forward(F.dropout(x, 0.1, self.training), labels)


def _dataset() -> Any:
    x, y = field_task.teacher_data(STEPS * BATCH, 0)
    return torch.utils.data.TensorDataset(x, y)


def _opt_sched(params: Any) -> tuple[Any, Any]:
    from tests.policy.test_field_frameworks import lr_lambda

    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


# ------------------------------------------------------------------ HF Trainer
def _hf_run(d: str, fault: bool | str, guarded: bool, canary: int = 4, model: Any = None,
            save_steps: int = 50) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    from stability.adapters.hf import StabilityTrainerCallback

    model = model if model is not None else Net(0)
    weights: dict[int, list[Any]] = {}

    class Record(transformers.TrainerCallback):  # after the stability callback
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if cb is not None and cb.guard is not None:
                weights[cb.guard.step_count - 1] = [p.detach().clone()
                                                    for p in model.parameters()]

    args = transformers.TrainingArguments(
        d, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=3e-3,
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=50, save_strategy="steps",
        save_steps=save_steps, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        data_seed=0, dataloader_num_workers=0, remove_unused_columns=False)
    opt, sched = _opt_sched(model.parameters())
    cb = StabilityTrainerCallback(Monitor("small"), checkpoint_every=25,
                                  canary=canary) if guarded else None
    tr = transformers.Trainer(model=model, args=args, train_dataset=_dataset(),
                              data_collator=Collate(fault, as_dict=True),
                              optimizers=(opt, sched),
                              callbacks=[Record()] + ([cb] if cb is not None else []))
    tr.remove_callback(transformers.trainer_callback.PrinterCallback)
    tr.train()
    tr.save_model(os.path.join(d, "final"))
    return {"model": model, "cb": cb, "weights": weights, "trainer": tr,
            "held": held_out(model)}


def _saved_hf_weights(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        return load_file(st)
    return torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)


def _equal(params: list[Any], ref: list[Any]) -> bool:
    return all(torch.equal(p.detach(), q) for p, q in zip(params, ref, strict=True))


def test_hf_bad_data_to_the_end_stops_with_the_healthy_weights_saved() -> None:
    """No eval_dataset, canary on by default: the shuffled labels are memorised, the canary
    sees it, the run stops with the weights of a pre-fault step in the model, in
    ``save_model`` afterwards and in every checkpoint written from the stop on."""
    with tempfile.TemporaryDirectory() as d0:
        unguarded = _hf_run(d0, True, False)["held"]
    with tempfile.TemporaryDirectory() as d:
        r = _hf_run(d, True, True)
        cb, model = r["cb"], r["model"]
        assert cb.guard.canary is not None and cb.guard.canary.evaluations > 0
        assert cb.stopped is not None, [(i.step, i.type, i.cause) for i in cb.guard.interventions]
        step = cb.stopped.restored_step
        assert step is not None and step < BAD_FROM, cb.stopped.reason
        assert _equal(list(model.parameters()), r["weights"][step])
        names = [n for n, _ in model.named_parameters()]
        saved = _saved_hf_weights(os.path.join(d, "final"))
        assert _equal([saved[n] for n in names], r["weights"][step])
        end = r["trainer"].state.global_step
        for ck in glob.glob(os.path.join(d, "checkpoint-*")):
            if int(ck.rsplit("-", 1)[1]) >= end:  # written at or after the stop
                sd = _saved_hf_weights(ck)
                assert _equal([sd[n] for n in names], r["weights"][step]), ck
        assert r["held"] < unguarded, (r["held"], unguarded)


def test_hf_a_clean_run_is_bit_identical_with_and_without_the_canary() -> None:
    """Invariant 1 with the default-on canary: dropout model, weights equal bit for bit."""
    runs = []
    for canary in (4, 0):
        with tempfile.TemporaryDirectory() as d:
            runs.append(_hf_run(d, False, True, canary=canary, model=DropoutNet(0),
                                save_steps=1000))
    on, off = runs
    assert on["cb"].guard.canary.evaluations >= 10  # it really evaluated
    assert off["cb"].guard.canary is None
    assert on["cb"].stopped is None
    assert [i for i in on["cb"].guard.interventions if i.type != "alert"] == []
    assert _equal(list(on["model"].parameters()), list(off["model"].parameters()))


def _same_batches(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        a_i.keys() == b_i.keys() and all(torch.equal(a_i[k], b_i[k]) for k in a_i
                                         if isinstance(a_i[k], torch.Tensor))
        if isinstance(a_i, dict) else all(torch.equal(x, y) for x, y in zip(a_i, b_i, strict=True))
        for a_i, b_i in zip(a, b, strict=True))


def test_hf_a_resumed_run_goes_on_with_the_same_canary() -> None:
    """``train(resume_from_checkpoint=...)``: the canary's batches (``stability_canary.pt`` in
    the checkpoint) and state (``trainer_state.json``) come back, so the resumed run evaluates
    the same batches and ends with the canary value and decisions of the uninterrupted run."""
    with tempfile.TemporaryDirectory() as d:
        full = _hf_run(d, False, True, save_steps=100)
        ck = os.path.join(d, "checkpoint-200")
        assert os.path.isfile(os.path.join(ck, "stability_canary.pt"))
        transformers = pytest.importorskip("transformers")
        from stability.adapters.hf import StabilityTrainerCallback

        model = Net(0)
        args = full["trainer"].args
        opt, sched = _opt_sched(model.parameters())
        cb = StabilityTrainerCallback(Monitor("small"), checkpoint_every=25)
        tr = transformers.Trainer(model=model, args=args, train_dataset=_dataset(),
                                  data_collator=Collate(False, as_dict=True),
                                  optimizers=(opt, sched), callbacks=[cb])
        tr.remove_callback(transformers.trainer_callback.PrinterCallback)
        tr.train(resume_from_checkpoint=ck)
    a, b = full["cb"].guard, cb.guard
    assert a.canary is not None and b.canary is not None
    assert _same_batches(a.canary.batches, b.canary.batches)
    assert b.canary.scale == 1.0  # its own batches: no rebase
    assert b.canary.evaluations == a.canary.evaluations
    assert b.canary.last == a.canary.last
    assert [(i.step, i.type) for i in b.interventions] == [
        (i.step, i.type) for i in a.interventions if i.step >= 200]


# ------------------------------------------------------------------ Lightning
def _pl_run(d: str, fault: bool | str, guarded: bool, canary: int = 4, model: Any = None,
            ckpt: str | None = None, max_steps: int = STEPS) -> dict[str, Any]:
    L = pytest.importorskip("lightning")
    from stability.adapters.lightning import StabilityCallback

    model = model if model is not None else Net(0)
    weights: dict[int, list[Any]] = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(batch[0], batch[1])["loss"]

        def configure_optimizers(self) -> Any:
            opt, sched = _opt_sched(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            if cb is not None and cb.guard is not None:
                weights[cb.guard.step_count - 1] = [p.detach().clone()
                                                    for p in model.parameters()]

    def canary_loss(module: Any, batch: Any) -> Any:
        return module.model(batch[0], batch[1])["loss"]

    dl = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, shuffle=True,
                                     generator=torch.Generator().manual_seed(0),
                                     collate_fn=Collate(fault, as_dict=False))
    cb = StabilityCallback(Monitor("small"), checkpoint_dir=os.path.join(d, "ck"),
                           checkpoint_every=25, canary=canary or None,
                           canary_loss=canary_loss if canary else None) if guarded else None
    torch.manual_seed(0)
    tr = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, gradient_clip_val=1.0,
                   callbacks=([cb] if cb is not None else []) + [Record()], default_root_dir=d)
    module = Module()
    tr.fit(module, dl, ckpt_path=ckpt)
    tr.save_checkpoint(os.path.join(d, "final.ckpt"))
    return {"model": model, "cb": cb, "weights": weights, "trainer": tr,
            "held": held_out(model)}


def test_lightning_bad_data_to_the_end_stops_with_the_healthy_weights_saved() -> None:
    with tempfile.TemporaryDirectory() as d0:
        unguarded = _pl_run(d0, True, False)["held"]
    with tempfile.TemporaryDirectory() as d:
        r = _pl_run(d, True, True)
        cb, model = r["cb"], r["model"]
        assert cb.guard.canary is not None and cb.guard.canary.evaluations > 0
        assert cb.stopped is not None, [(i.step, i.type, i.cause) for i in cb.guard.interventions]
        step = cb.stopped.restored_step
        assert step is not None and step < BAD_FROM, cb.stopped.reason
        assert _equal(list(model.parameters()), r["weights"][step])
        sd = torch.load(os.path.join(d, "final.ckpt"), weights_only=False)["state_dict"]
        names = [f"model.{n}" for n, _ in model.named_parameters()]
        assert _equal([sd[n] for n in names], r["weights"][step])
        assert r["held"] < unguarded, (r["held"], unguarded)


def test_lightning_a_clean_run_is_bit_identical_with_and_without_the_canary() -> None:
    runs = []
    for canary in (4, 0):
        with tempfile.TemporaryDirectory() as d:
            runs.append(_pl_run(d, False, True, canary=canary, model=DropoutNet(0)))
    on, off = runs
    assert on["cb"].guard.canary.evaluations >= 10
    assert off["cb"].guard.canary is None
    assert on["cb"].stopped is None
    assert [i for i in on["cb"].guard.interventions if i.type != "alert"] == []
    assert _equal(list(on["model"].parameters()), list(off["model"].parameters()))


def test_lightning_canary_needs_a_loss_function() -> None:
    pytest.importorskip("lightning")
    from stability.adapters.lightning import StabilityCallback

    with pytest.raises(ValueError, match="canary_loss"):
        StabilityCallback(Monitor("small"), canary=4)


def test_lightning_the_canary_travels_in_the_checkpoint() -> None:
    """``fit(ckpt_path=...)``: the callback state in a Lightning checkpoint carries the canary's
    batches and state; the resumed guard evaluates the same batches (no rebase)."""
    with tempfile.TemporaryDirectory() as d:
        full = _pl_run(d, False, True, max_steps=200)
        again = _pl_run(d, False, True, ckpt=os.path.join(d, "final.ckpt"), max_steps=250)
    a, b = full["cb"].guard.canary, again["cb"].guard.canary
    assert a is not None and b is not None and a.full
    assert _same_batches(a.batches, b.batches)
    assert b.steps == a.steps and b.scale == 1.0
    assert b.evaluations == a.evaluations + 2  # steps 225 and 250 of the resumed run


@pytest.mark.parametrize("runner", [_hf_run, _pl_run], ids=["hf", "lightning"])
def test_a_memorised_20_batch_window_ends_no_worse_than_unguarded(runner: Any) -> None:
    """A stuck loader feeds one corrupt batch 20 times (the model memorises it); with the canary
    the guarded run ends no worse than the unguarded one, and does not stop."""
    out = {}
    for name, fault, guarded in (("clean", False, False), ("unguarded", "stuck", False),
                                 ("guarded", "stuck", True)):
        with tempfile.TemporaryDirectory() as d:
            out[name] = runner(d, fault, guarded)
    cb = out["guarded"]["cb"]
    held = {k: v["held"] for k, v in out.items()}
    assert cb.stopped is None, cb.stopped
    assert held["unguarded"] > 1.02 * held["clean"], held  # (the fault does matter)
    assert held["guarded"] <= held["unguarded"], held
