"""Lightning rollback targets are verified loadable when written (issue 27, item 2).

A module whose ``save_hyperparameters`` holds an ``argparse.Namespace``, a ``pathlib.Path`` or
a NumPy scalar still rolls back: the callback's rollback checkpoints store those as plain data
(the user is told once).  A checkpoint the safe loader still refuses (something the module adds
in its own ``on_save_checkpoint``) is never registered as a rollback target, and the user is told
at once, not at the fault.
"""

from __future__ import annotations

import argparse
import logging
import pathlib

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")
np = pytest.importorskip("numpy")

from stability.adapters.lightning import StabilityCallback  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)


class _Module(L.LightningModule):
    def __init__(self, args=None, root=None, lr=None, smuggle: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.smuggle = smuggle

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_save_checkpoint(self, checkpoint) -> None:
        if self.smuggle:  # after the callbacks: the written file holds a class
            checkpoint["mine"] = argparse.Namespace(x=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class _Scripted:
    def __init__(self, script) -> None:
        self.script = script
        self.control = Control()

    def observe(self, step, metrics=None, families=None):
        return Decision(step, control=self.script.pop(step, Control()))


def _fit(tmp_path, module, script):
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    cb = StabilityCallback(_Scripted(script), checkpoint_every=5)
    tr = L.Trainer(max_steps=20, callbacks=[cb], enable_progress_bar=False, logger=False,
                   enable_checkpointing=False, enable_model_summary=False, accelerator="cpu",
                   default_root_dir=str(tmp_path))
    tr.fit(module, loader)
    return cb


def test_hparams_the_safe_loader_refuses_do_not_block_rollbacks(tmp_path, caplog) -> None:
    module = _Module(args=argparse.Namespace(a=1), root=pathlib.Path("/data"),
                     lr=np.float32(0.1))
    with caplog.at_level(logging.WARNING, "stability.adapters"):
        cb = _fit(tmp_path, module, {12: Control(rollback_to=9)})
    assert cb.guard is not None and cb.guard.rollbacks == 1
    assert caplog.text.count("stored as plain data") == 1  # told once, at the first one
    assert "hyper_parameters.args (Namespace)" in caplog.text
    # retention may have pruned step 9 since (the rollback's 3 steps were given back to
    # max_steps): every rollback checkpoint is written the same way
    kept = sorted((tmp_path / "stability-checkpoints").glob("step=*.ckpt"))
    assert kept
    ck = torch.load(kept[-1], weights_only=True)
    assert ck["hyper_parameters"]["args"] == {"a": 1}
    assert ck["hyper_parameters"]["root"] == "/data"


def test_an_unloadable_rollback_target_is_reported_when_written(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, "stability.adapters"):
        cb = _fit(tmp_path, _Module(smuggle=True), {})
    first = next(r for r in caplog.records if "cannot be loaded" in r.getMessage())
    assert "step=4.ckpt" in first.getMessage() and first.levelno == logging.ERROR
    assert cb.store.entries == {}  # never a rollback target
    assert not list((tmp_path / "stability-checkpoints").glob("*.ckpt"))
