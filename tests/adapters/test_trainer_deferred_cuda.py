"""The trainer callbacks with ``sync="deferred"`` on a real CUDA device (HF and Lightning AMP).

Skipped where no GPU is present (CI has none); run on a machine with one::

    python -m pytest tests/adapters/test_trainer_deferred_cuda.py

fp16 uses the frameworks' own CUDA GradScaler (accelerate's, Lightning's ``16-mixed``), bf16
their autocast.  Host syncs are counted with ``torch.cuda.set_sync_debug_mode("warn")`` inside
the callbacks' step hooks.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from stability.monitor.monitor import Monitor  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS


def _wrap_syncs(cb: Any, hooks: tuple[str, ...]) -> dict[str, list[int]]:
    """Count the CUDA host syncs inside each call of ``hooks`` of ``cb``."""
    per: dict[str, list[int]] = {h: [] for h in hooks}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(*a, **k)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    per[name].append(sum("synchroniz" in str(m.message) for m in w))
        return counted

    for h in hooks:
        setattr(cb, h, wrap(h, getattr(cb, h)))
    return per


def _net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def _data(n: int = 512) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    return x, (x @ torch.randn(16, 4, generator=g)).argmax(1)


# ---------------------------------------------------------------------- HF Transformers
transformers = pytest.importorskip("transformers")

from stability.adapters.hf import StabilityTrainerCallback  # noqa: E402


class _HFNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
        out = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(out.float(), labels), "logits": out}


class _HFData(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i]}


def _hf(out: Any, sync: str, precision: str, steps: int = 40, nan_at: int = -1,
        count: bool = False) -> dict[str, Any]:
    model = _HFNet()
    mon = Monitor("small", alert_sinks=[])
    cb = StabilityTrainerCallback(mon, sync=sync)
    args = transformers.TrainingArguments(
        str(out), max_steps=steps, per_device_train_batch_size=32, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=100, save_strategy="steps", save_steps=15,
        report_to=[], disable_tqdm=True, eval_strategy="no", optim="adamw_torch_fused",
        bf16=precision == "bf16", fp16=precision == "fp16", dataloader_pin_memory=False)
    tr = transformers.Trainer(model=model, args=args, train_dataset=_HFData(), callbacks=[cb])
    if nan_at >= 0:
        flag = {"on": False}
        model.net[0].weight.register_hook(lambda g: g * math.nan if flag["on"] else g)

        class Poison(transformers.TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                flag["on"] = state.global_step == nan_at

        tr.add_callback(Poison())
    per = _wrap_syncs(cb, ("on_pre_optimizer_step", "on_step_end")) if count else {}
    tr.train()
    return {"cb": cb, "tr": tr, "per": per,
            "weights": [p.detach().clone() for p in model.parameters()],
            "events": [(i.step, i.type) for i in cb.guard.interventions],
            "ledger": [(r.step, r.healthy) for r in mon.checkpoints.records]}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_hf_on_the_gpu_deferred_is_step_mode_without_syncs(tmp_path: Any, precision: str) -> None:
    a = _hf(tmp_path / "a", "step", precision, count=True)
    b = _hf(tmp_path / "b", "deferred", precision, count=True)
    assert b["events"] == a["events"] and b["ledger"] == a["ledger"] == [(14, True), (29, True),
                                                                         (39, True)]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    if precision == "fp16":
        assert b["cb"].guard.scaler is not None
        assert b["cb"].guard.amp_overflows == a["cb"].guard.amp_overflows
    steady = [i for i in range(3, 40) if i not in (14, 29, 39)]  # (save steps observe first)
    assert min(a["per"]["on_pre_optimizer_step"][3:]) >= 1
    for hook, counts in b["per"].items():
        assert [counts[i] for i in steady] == [0] * len(steady), hook


def test_hf_on_the_gpu_nan_gradient_never_reaches_the_weights(tmp_path: Any) -> None:
    r = _hf(tmp_path, "deferred", "bf16", nan_at=25)
    assert all(torch.isfinite(p).all() for p in r["weights"])
    assert any(s == 25 for s, _ in r["events"]) and r["tr"].state.global_step == 40


def test_hf_on_the_gpu_auto_is_deferred_with_the_fused_optimizer(tmp_path: Any) -> None:
    r = _hf(tmp_path, "auto", "bf16", count=True)  # optim="adamw_torch_fused"
    assert r["cb"].sync == "auto" and r["cb"].guard.sync_mode == "deferred"
    steady = [i for i in range(3, 40) if i not in (14, 29, 39)]
    for hook, counts in r["per"].items():
        assert [counts[i] for i in steady] == [0] * len(steady), hook


# ---------------------------------------------------------------------- Lightning
L = pytest.importorskip("lightning")

from stability.adapters.lightning import StabilityCallback  # noqa: E402


class _Lit(L.LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.net = _net()
        self.fused = fused

    def training_step(self, batch: Any, idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=self.fused)


def _lightning(root: Any, sync: str, precision: str, fused: bool) -> dict[str, Any]:
    model = _Lit(fused)
    mon = Monitor("small", alert_sinks=[])
    cb = StabilityCallback(mon, sync=sync, checkpoint_every=15, clip_norm=1.0)
    per = _wrap_syncs(cb, ("on_before_backward", "on_before_optimizer_step",
                           "on_train_batch_end"))
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    tr = L.Trainer(max_steps=40, callbacks=[cb], accelerator="gpu", devices=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(root),
                   precision="16-mixed" if precision == "fp16" else "bf16-mixed")
    tr.fit(model, loader)
    return {"cb": cb, "per": per, "weights": [p.detach().clone() for p in model.parameters()],
            "events": [(i.step, i.type) for i in cb.guard.interventions],
            "ledger": [(r.step, r.healthy) for r in mon.checkpoints.records]}


@pytest.mark.parametrize(("precision", "fused"), [("fp16", True), ("fp16", False),
                                                 ("bf16", True)])
def test_lightning_on_the_gpu_deferred_is_step_mode_without_syncs(tmp_path: Any, precision: str,
                                                                   fused: bool) -> None:
    # (without a fused optimizer Lightning unscales the fp16 gradients before the hook)
    a = _lightning(tmp_path / "a", "step", precision, fused)
    b = _lightning(tmp_path / "b", "deferred", precision, fused)
    assert b["events"] == a["events"] and b["ledger"] == a["ledger"] == [(14, True), (29, True)]
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    if precision == "fp16":
        assert b["cb"].guard.scaler is not None
    steady = [i for i in range(3, 40) if i not in (14, 29)]  # (checkpoint steps)
    assert min(a["per"]["on_before_optimizer_step"][3:]) >= 1
    for hook, counts in b["per"].items():
        if hook == "on_before_backward":  # one call per step (no accumulation)
            assert counts[3:] == [0] * len(counts[3:])
        else:
            assert [counts[i] for i in steady] == [0] * len(steady), hook


@pytest.mark.parametrize("fused", [True, False])
def test_lightning_on_the_gpu_auto_is_deferred_with_a_fused_optimizer(tmp_path: Any,
                                                                      fused: bool) -> None:
    r = _lightning(tmp_path, "auto", "bf16", fused)
    assert r["cb"].guard.sync_mode == ("deferred" if fused else "step")
    steady = [i for i in range(3, 40) if i not in (14, 29)]
    counts = r["per"]["on_before_optimizer_step"]
    if fused:
        assert [counts[i] for i in steady] == [0] * len(steady)
    else:  # step mode: its host sync
        assert min(counts[i] for i in steady) >= 1
