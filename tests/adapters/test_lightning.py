"""StabilityCallback with real Lightning on CPU and a tiny model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from stability.adapters.lightning import StabilityCallback  # noqa: E402
from stability.monitor import Monitor  # noqa: E402
from stability.types import Control, Decision  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, nan_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))
        self.nan_at = nan_at
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.nan_at:
            loss = loss * float("nan")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_train_batch_start(self, batch, batch_idx):
        self.weights.append(self.net[0].weight.detach().clone())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(n: int = 256):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(cb, steps: int = 30, **kw):
    return L.Trainer(max_steps=steps, callbacks=[cb], enable_progress_bar=False, logger=False,
                     enable_checkpointing=False, enable_model_summary=False, accelerator="cpu",
                     num_sanity_val_steps=0, **kw)


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
        return {"version": 1, "n": len(self.seen)}

    def load_state_dict(self, sd):
        pass


def test_skip_lr_factor_and_stop() -> None:
    ctl = {5: Control(skip_step=True), 8: Control(lr_factor=0.5),
           12: Control(stop=True, stop_reason="scripted")}
    mon = _Scripted(ctl)
    model = Tiny()
    cb = StabilityCallback(mon, checkpoint_every=0)
    _trainer(cb, gradient_clip_val=1.0).fit(model, _loader(), _loader(32))
    assert mon.seen == list(range(13))  # one observe per optimizer step, then stopped
    assert cb.stopped is not None and cb.stopped.reason == "scripted"
    assert torch.equal(model.weights[5], model.weights[6])  # the skipped step changed nothing
    assert not torch.equal(model.weights[4], model.weights[5])
    assert {"loss", "grad_norm", "lr"} <= set(mon.metrics[0])
    opt = cb.guard.optimizer
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # scheduler's value kept


def test_real_monitor_nan_skipped_and_state_roundtrip(tmp_path) -> None:
    model = Tiny(nan_at=45)
    cb = StabilityCallback(Monitor("small"), checkpoint_every=10)
    trainer = _trainer(cb, steps=60, val_check_interval=20)
    trainer.fit(model, _loader(), _loader(32))
    kinds = {i.type for i in cb.guard.interventions}
    assert "skip_step" in kinds
    assert all(torch.isfinite(p).all() for p in model.parameters())
    sd = cb.state_dict()
    assert sd["version"] == 1 and sd["monitor"] is not None
    cb2 = StabilityCallback(Monitor("small"))
    cb2.load_state_dict(sd)
    assert cb2.state_dict() == sd
