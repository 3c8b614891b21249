"""StabilityCallback with real Lightning on CPU and a tiny model."""

from __future__ import annotations

import csv
import glob
import os

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from stability.adapters.lightning import StabilityCallback  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402
from stability.types import Control, Decision  # noqa: E402

torch.set_num_threads(1)


class Tiny(L.LightningModule):
    def __init__(self, nan_at: int = -1, raise_at: int = -1, poison_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))
        self.nan_at, self.raise_at, self.poison_at = nan_at, raise_at, poison_at
        self.weights: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.raise_at:
            raise RuntimeError("user code failed")
        if self.global_step == self.poison_at:
            with torch.no_grad():
                self.net[0].weight[0, 0] = float("nan")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
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


def _trainer(tmp_path, cb, steps: int = 30, **kw):
    opts = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False,
                enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
                default_root_dir=str(tmp_path))
    opts.update(kw)
    return L.Trainer(max_steps=steps, callbacks=[cb], **opts)


class _Scripted:
    def __init__(self, script):
        self.script = script
        self.seen = []
        self.metrics = []
        self.control = Control()

    def observe(self, step, metrics=None, families=None):
        self.seen.append(step)
        self.metrics.append(dict(metrics or {}))
        return Decision(step, control=self.script.pop(step, Control()))  # each fires once

    def state_dict(self):
        return {"version": 1, "n": len(self.seen)}

    def load_state_dict(self, sd):
        pass


def test_skip_lr_factor_and_stop(tmp_path) -> None:
    ctl = {5: Control(skip_step=True), 8: Control(lr_factor=0.5),
           12: Control(stop=True, stop_reason="scripted")}
    mon = _Scripted(ctl)
    model = Tiny()
    cb = StabilityCallback(mon, checkpoint_every=0)
    _trainer(tmp_path, cb, gradient_clip_val=1.0).fit(model, _loader(), _loader(32))
    assert mon.seen == list(range(13))  # one observe per optimizer step, then stopped
    assert cb.stopped is not None and cb.stopped.reason == "scripted"
    assert torch.equal(model.weights[5], model.weights[6])  # the skipped step changed nothing
    assert not torch.equal(model.weights[4], model.weights[5])
    assert {"loss", "grad_norm", "lr"} <= set(mon.metrics[0])
    opt = cb.guard.optimizer
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)  # scheduler's value kept


def test_state_key_and_resume_with_ckpt_path(tmp_path) -> None:
    cb = StabilityCallback(Monitor("small"), checkpoint_every=10)
    tr = _trainer(tmp_path, cb, steps=30)
    tr.fit(Tiny(), _loader())
    path = str(tmp_path / "mid.ckpt")
    tr.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["callbacks"][cb.state_key]
    assert cb.state_key == "StabilityCallback{'val_key': 'val_loss'}"
    assert saved["guard"]["step"] == 30 and saved["guard"]["monitor"]["last_step"] == 29
    cb2 = StabilityCallback(Monitor("small"), checkpoint_every=10)
    seen, loaded = [], {}
    orig = cb2.monitor.observe

    def spy(step, *a, **k):
        if not loaded:
            loaded.update(cb2.guard.state_dict())
        seen.append(step)
        return orig(step, *a, **k)

    cb2.monitor.observe = spy
    _trainer(tmp_path, cb2, steps=40).fit(Tiny(), _loader(), ckpt_path=path)
    assert seen == list(range(30, 40))  # warm-ups did not restart
    assert loaded["monitor"] == saved["guard"]["monitor"]  # the state came back as saved
    recs = saved["guard"]["monitor"]["checkpoints"]["records"]  # the one registry
    assert [r["step"] for r in recs] == [19, 29]  # keep_checkpoints=2
    assert sorted(cb2.store.entries) == [29, 39]  # the registry came back and went on
    assert [r.step for r in cb2.monitor.checkpoints.records] == [29, 39]
    assert sorted(p.name for p in (tmp_path / "stability-checkpoints").glob("*.ckpt")) == [
        "step=29.ckpt", "step=39.ckpt"]  # pruned files went with their records


def test_resume_gives_the_decisions_of_an_uninterrupted_run(tmp_path) -> None:
    def run(d, resume):
        cb = StabilityCallback(Monitor("small"), checkpoint_every=10)
        if not resume:
            _trainer(d, cb, steps=64).fit(Tiny(nan_at=50), _loader())
            return [cb], None
        tr = _trainer(d, cb, steps=32)
        tr.fit(Tiny(nan_at=50), _loader())  # 32 steps = one epoch: a clean resume point
        tr.save_checkpoint(str(d / "r.ckpt"))
        cb2 = StabilityCallback(Monitor("small"), checkpoint_every=10)
        _trainer(d, cb2, steps=64).fit(Tiny(nan_at=50), _loader(), ckpt_path=str(d / "r.ckpt"))
        return [cb, cb2], cb2

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref, _ = run(tmp_path / "a", False)
    res, cb2 = run(tmp_path / "b", True)

    def events(cbs):
        return [(i.step, i.type, i.reason) for c in cbs for i in c.guard.interventions]

    assert events(ref) and events(res) == events(ref)
    assert cb2.guard.steps_skipped == ref[0].guard.steps_skipped


def test_on_exception_removes_hooks(tmp_path) -> None:
    model = Tiny(raise_at=5)
    cb = StabilityCallback(Monitor("small"), checkpoint_every=0, activations=["net.0"],
                           activation_every=1)
    with pytest.raises(RuntimeError, match="user code failed"):
        _trainer(tmp_path, cb).fit(model, _loader())
    opt = cb.guard.optimizer
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not model.net[0]._forward_hooks


@pytest.mark.parametrize("log_keys", ["core", "all"])
def test_metrics_reach_the_csv_logger(tmp_path, log_keys) -> None:
    from lightning.pytorch.loggers import CSVLogger

    cb = StabilityCallback(Monitor("small"), checkpoint_every=0, log_keys=log_keys)
    _trainer(tmp_path, cb, steps=10, logger=CSVLogger(str(tmp_path)),
             log_every_n_steps=2).fit(Tiny(), _loader())
    (f,) = glob.glob(str(tmp_path / "lightning_logs" / "version_*" / "metrics.csv"))
    with open(f, newline="") as fh:
        rows = list(csv.DictReader(fh))
    core = [r for r in rows if r.get("stability/lr_factor")]
    assert len(core) == 5 and all(float(r["stability/lr_factor"]) == 1.0 for r in core)
    assert float(core[0]["stability/lr_effective"]) == pytest.approx(1e-2)
    scores = any(r.get("stability/score/loss_spike") for r in rows)
    assert scores == (log_keys == "all")
    # the core keys: one row per logged step; "all": the rest at the same step
    assert sorted({r["step"] for r in rows}) == ["1", "3", "5", "7", "9"]
    assert len(rows) == (5 if log_keys == "core" else 10)


def test_emergency_checkpoint_resumes_with_lightning(tmp_path) -> None:
    mon = _Scripted({3: Control(save_checkpoint=True, checkpoint_reason="scripted")})
    cb = StabilityCallback(mon, checkpoint_every=0)
    _trainer(tmp_path, cb, steps=6).fit(Tiny(), _loader())
    path = tmp_path / "stability-checkpoints" / "emergency-step=3.ckpt"
    assert path.exists() and not cb.store.entries[3].healthy
    cb2 = StabilityCallback(_Scripted({}), checkpoint_every=0)
    tr = _trainer(tmp_path, cb2, steps=8)
    tr.fit(Tiny(), _loader(), ckpt_path=str(path))
    assert tr.global_step == 8


def test_no_checkpoint_of_nonfinite_weights(tmp_path) -> None:
    mon = _Scripted({3: Control(save_checkpoint=True, checkpoint_reason="nan")})
    cb = StabilityCallback(mon, checkpoint_every=2)
    tr = _trainer(tmp_path, cb, steps=6)
    tr.fit(Tiny(poison_at=3), _loader())
    files = sorted(p for p in os.listdir(tmp_path / "stability-checkpoints")
                   if p.endswith(".ckpt"))  # (and the directory's lock file)
    assert files == ["step=1.ckpt"]  # nothing after the weights went NaN at step 3
    assert cb.cancelled_saves == [4, 6]  # the emergency one (step 3) and the periodic step 5


def test_step_counters_after_rollback(tmp_path) -> None:
    mon = _Scripted({7: Control(rollback_to=3, skip_batches=(6, 7))})
    model = Tiny()
    cb = StabilityCallback(mon, checkpoint_every=2)
    tr = _trainer(tmp_path, cb, steps=12)
    tr.fit(model, _loader())
    g = cb.guard
    assert g.rollbacks == 1 and g.steps_lost == 4
    assert torch.equal(model.weights[4], model.weights[8])  # weights after step 3 restored
    # the 4 lost steps are given back: 12 healthy steps, as asked (extend_max_steps)
    assert tr.global_step == 16 == g.step_count + g.steps_lost and g.step_count == 12
    assert tr.max_steps == 12  # the user's setting, back when fit ends
    assert mon.seen == list(range(8)) + list(range(4, 12))  # the guard's step went back


def test_lost_steps_come_out_of_max_steps_without_extend_max_steps(tmp_path) -> None:
    mon = _Scripted({7: Control(rollback_to=3, skip_batches=(6, 7))})
    cb = StabilityCallback(mon, checkpoint_every=2, extend_max_steps=False)
    tr = _trainer(tmp_path, cb, steps=12)
    tr.fit(Tiny(), _loader())
    g = cb.guard
    assert tr.global_step == 12 == g.step_count + g.steps_lost and g.steps_lost == 4
    assert mon.seen == list(range(8)) + list(range(4, 8))


def test_lost_steps_given_back_at_most_the_budget_asked(tmp_path) -> None:
    """A rollback that recurs (a scripted monitor that rolls back on every pass through step 7)
    cannot extend the run without end: at most ``max_steps`` more."""

    class Again(_Scripted):
        def observe(self, step, metrics=None, families=None):
            d = super().observe(step, metrics, families)
            if step == 7:
                self.script[7] = Control(rollback_to=3, skip_batches=(6, 7))
            return d

    mon = Again({7: Control(rollback_to=3, skip_batches=(6, 7))})
    cb = StabilityCallback(mon, checkpoint_every=2)
    tr = _trainer(tmp_path, cb, steps=12)
    tr.fit(Tiny(), _loader())
    assert tr.global_step == 24 and cb.guard.rollbacks >= 3


def test_fp16_scaler_overflows_are_information(tmp_path) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    cb = StabilityCallback(Monitor("small"), checkpoint_every=0)
    model = Tiny()
    seen = []
    orig = cb.monitor.observe

    def spy(step, metrics=None, families=None):
        seen.append(dict(metrics or {}))
        return orig(step, metrics, families=families)

    cb.monitor.observe = spy
    _trainer(tmp_path, cb, steps=20,
             plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(model, _loader())
    g = cb.guard
    assert g.scaler is scaler and g.amp_overflows >= 3
    assert seen[0]["amp_overflow"] == 1.0 and "grad_norm" not in seen[0]
    assert all(0 < m["loss"] < 100 for m in seen)  # the unscaled loss, not loss * 2**40
    assert not [i for i in g.interventions if i.type in ("skip_step", "rollback", "stop")]


def test_in_memory_checkpoints_bounded(tmp_path) -> None:
    cb = StabilityCallback(Monitor("small"), checkpoint_every=2, in_memory=True,
                           memory_limit_mb=0.0001)
    _trainer(tmp_path, cb, steps=6).fit(Tiny(), _loader())
    assert cb.store.memory_bytes() == 0 and cb.guard.checkpoint_failures >= 1
    assert not (tmp_path / "stability-checkpoints").exists()
    cb2 = StabilityCallback(Monitor("small"), checkpoint_every=2, in_memory=True,
                            memory_limit_mb=0.01)
    _trainer(tmp_path, cb2, steps=12).fit(Tiny(), _loader())
    assert 0 < cb2.store.memory_bytes() <= 0.01 * 2**20


def test_real_monitor_nan_skipped(tmp_path) -> None:
    model = Tiny(nan_at=45)
    cb = StabilityCallback(Monitor("small"), checkpoint_every=10)
    _trainer(tmp_path, cb, steps=60, val_check_interval=20).fit(model, _loader(), _loader(32))
    assert "skip_step" in {i.type for i in cb.guard.interventions}
    assert all(torch.isfinite(p).all() for p in model.parameters())
