"""Every ```python block of README.md runs as written; every ```toml block is a valid config.

Each python block is executed in a fresh temporary working directory with a *prelude*: the
names a snippet may use without defining them.  Keep README snippets within these names (or
make them self-contained):

==========================  ====================================================================
always                      ``torch``, ``Monitor`` (imported by the first snippet); ``model``
                            (an MLP with ``model.blocks`` and ``head``),
                            ``optimizer`` (AdamW), ``scheduler`` (warm-up ``LambdaLR``),
                            ``n_batches`` (40), ``get_batch(i)`` (deterministic ``x, y``),
                            ``loss_fn`` (MSE); ``guard`` (a guard attached to them, for snippets
                            that continue a previous one); framework-free: ``step``, ``loss``,
                            ``lr``, ``gn``, ``layer_names``, ``stds``; recording: ``n_steps``,
                            ``train_step()`` (returns ``loss, lr, grad_norm``)
the snippet names           ``model`` is a ``lightning.LightningModule`` and ``train_loader`` a
``lightning``               ``DataLoader``; ``L`` is ``lightning``
the snippet names           ``model`` is a tiny GPT-2 (``transformers``, built from a config, no
``adapters.hf``             download), ``args`` are ``TrainingArguments`` for 6 steps,
                            ``ds`` / ``train`` / ``val`` are lists of ``input_ids``/``labels``
                            examples; ``Trainer``, ``TrainingArguments`` are imported
==========================  ====================================================================

``monitor.toml`` in the working directory holds the latest ```toml block above the snippet.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str, str | None, int]]:
    """``(lang, code, latest toml before it, line)`` for every fenced block, in order."""
    out = []
    toml = None
    text = README.read_text(encoding="utf-8")
    for m in _FENCE.finditer(text):
        lang, code = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start(2))  # tracebacks point at README lines
        out.append((lang, code, toml, line))
        if lang == "toml":
            toml = code
    return out


PYTHON = [("\n" * line + code, toml) for lang, code, toml, line in _blocks()
          if lang == "python"]
TOML = [code for lang, code, _, _ in _blocks() if lang == "toml"]


def _id(code: str) -> str:
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.startswith(("import",
                                                                                "from"))]
    return re.sub(r"\W+", "_", (lines[0] if lines else code)[:40]).strip("_")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] - 0.5 * x[:, 1:2]


def _prelude(code: str) -> dict[str, Any]:
    import stability.torch
    from stability import Monitor

    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    rec_state = {"i": 0}

    def train_step() -> tuple[float, float, float]:
        rec_state["i"] += 1
        return 2.0 / rec_state["i"], 1e-3, 0.5

    ns: dict[str, Any] = {
        "__name__": "__readme__", "torch": torch, "Monitor": Monitor, "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler, "n_batches": 40, "get_batch": _get_batch,
        "loss_fn": torch.nn.functional.mse_loss,
        "step": 0, "loss": 2.3, "lr": 1e-3, "gn": 0.7, "layer_names": ["blocks.0", "blocks.1"],
        "stds": [1.0, 1.1], "n_steps": 20, "train_step": train_step,
    }
    ns["guard"] = stability.torch.attach(model, optimizer, scheduler, Monitor("small"),
                                         checkpoint_every=0, log_interventions=False)
    for optional in ("pandas", "polars"):  # dev extras; a snippet using one skips without it
        if f"import {optional}" in code:
            pytest.importorskip(optional)
    if "lightning" in code:
        ns.update(_lightning_prelude())
    if "adapters.hf" in code:
        ns.update(_hf_prelude())
    return ns


def _lightning_prelude() -> dict[str, Any]:
    L = pytest.importorskip("lightning")

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net()

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    xs = torch.cat([_get_batch(i)[0] for i in range(4)])
    ys = xs[:, :1] - 0.5 * xs[:, 1:2]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16)
    return {"L": L, "model": Lit(), "train_loader": loader}


def _hf_prelude() -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    ex = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (24, 16), generator=g)]
    args = transformers.TrainingArguments(
        "hf_out", max_steps=6, per_device_train_batch_size=4, report_to=[], save_strategy="no",
        logging_steps=2, use_cpu=True, disable_tqdm=True)
    return {"model": model, "args": args, "ds": ex, "train": ex, "val": ex[:8],
            "Trainer": transformers.Trainer, "TrainingArguments": transformers.TrainingArguments}


def test_readme_has_snippets() -> None:
    assert len(PYTHON) >= 5 and TOML


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("code", "toml"), PYTHON, ids=[_id(c) for c, _ in PYTHON])
def test_python_snippet_runs(code: str, toml: str | None, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    from stability.config.registry import REGISTRY

    saved = dict(REGISTRY)  # a snippet may register a detector: restore the registry after it
    try:
        _run_snippet(code, toml, tmp_path)
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


def _run_snippet(code: str, toml: str | None, tmp_path: Path) -> None:
    if toml is not None:
        (tmp_path / "monitor.toml").write_text(toml)
    ns = _prelude(code)
    guard_before = ns["guard"]
    exec(compile(code, str(README), "exec"), ns)  # our own README
    guard = ns.get("guard")
    if guard is not None and guard is not guard_before:  # the snippet attached its own guard
        assert guard.step_count > 0 and guard.stopped is None
        assert all(math.isfinite(v) or k.startswith(("stability/score/", "stability/clip"))
                   for k, v in guard.metrics().items())
    if "d" in ns and hasattr(ns["d"], "control"):
        assert ns["d"].step == ns["step"]


@pytest.mark.parametrize("code", TOML, ids=[f"toml{i}" for i in range(len(TOML))])
def test_toml_snippet_is_a_valid_config(code: str) -> None:
    from stability.config.config import MonitorConfig

    MonitorConfig.from_toml(code)
