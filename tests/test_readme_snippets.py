"""Every ```python block of README.md and docs/**/*.md runs as written; every ```toml block is a
valid config; every printed output shown in them is what the block prints.

Each python block is executed in a fresh temporary working directory with a *prelude*: the
names a snippet may use without defining them.  Keep snippets within these names (or make them
self-contained):

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

``monitor.toml`` in the working directory holds the latest ```toml block above the snippet in
the same file.

**Printed output.** A ```text block right after the line ``<!-- output of the block above -->``
is the output of the python block before it (the next block after it, prose between them
allowed): that block is run as a standalone script (no
prelude, its own process, stdout and stderr together) and must print those lines; integers must
match exactly, decimals within 5 % (float32 arithmetic differs a little between CPUs).

**Sketches.** A python block right after ``<!-- sketch: not run -->`` is an API outline with
placeholders (``docs/CONTRACTS.md``; a bucket and a Ray cluster in ``docs/fleet.md``), not a
snippet: it is not run.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
OUTPUT_MARK = "<!-- output of the block above -->"
SKETCH_MARK = "<!-- sketch: not run -->"


class Block(NamedTuple):
    page: Path
    lang: str
    code: str  # padded with newlines so that tracebacks point at the page's lines
    toml: str | None  # the latest toml block above it in the same page
    output: str | None  # the printed output shown after it, if any
    line: int  # of its first line in the page

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    matches = list(_FENCE.finditer(text))
    out: list[Block] = []
    toml = None
    for k, m in enumerate(matches):
        lang, code = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start(2))
        nxt = matches[k + 1] if k + 1 < len(matches) else None
        output = None
        if (lang == "python" and nxt is not None and nxt.group(1) == "text"
                and text[m.end():nxt.start()].rstrip().endswith(OUTPUT_MARK)):
            output = nxt.group(2)
        if lang == "python" and text[:m.start()].rstrip().endswith(SKETCH_MARK):
            continue
        out.append(Block(page, lang, "\n" * line + code, toml, output, line + 1))
        if lang == "toml":
            toml = code
    return out


BLOCKS = [b for page in PAGES for b in _blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
TOML = [b for b in BLOCKS if b.lang == "toml"]


def _id(b: Block) -> str:
    lines = [ln for ln in b.code.splitlines() if ln.strip() and not ln.startswith(("import",
                                                                                  "from"))]
    return f"{b.where}:" + re.sub(r"\W+", "_", (lines[0] if lines else b.code)[:30]).strip("_")


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
        "__name__": "__readme__", "torch": torch, "stability": stability,
        "Monitor": Monitor, "model": model,
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


def test_readme_and_docs_have_snippets() -> None:
    readme = [b for b in PYTHON if b.page.name == "README.md"]
    assert readme and any(b.output for b in readme), "the README's example shows its output"
    assert len(PYTHON) >= 20 and TOML


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("block", PYTHON, ids=[_id(b) for b in PYTHON])
def test_python_snippet_runs(block: Block, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if block.output is not None:
        _check_output(block, tmp_path)
        return
    from stability.config.registry import REGISTRY

    saved = dict(REGISTRY)  # a snippet may register a detector: restore the registry after it
    try:
        _run_snippet(block, tmp_path)
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _same_line(want: str, got: str) -> bool:
    """Equal text; integers equal; decimals within 5 %."""
    if _NUMBER.sub("#", want) != _NUMBER.sub("#", got):
        return False
    for w, g in zip(_NUMBER.findall(want), _NUMBER.findall(got), strict=True):
        if re.fullmatch(r"[-+]?\d+", w):
            if w != g:
                return False
        elif not math.isclose(float(w), float(g), rel_tol=0.05, abs_tol=1e-12):
            return False
    return True


def _check_output(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert res.returncode == 0, f"{block.where}: the example failed\n{res.stdout[-3000:]}"
    want = [ln.rstrip() for ln in (block.output or "").strip("\n").splitlines()]
    got = [ln.rstrip() for ln in res.stdout.strip("\n").splitlines()]
    assert len(got) == len(want) and all(map(_same_line, want, got)), (
        f"{block.where}: the output shown differs from what the block prints now:\n"
        + "\n".join(got))


def _run_snippet(block: Block, tmp_path: Path) -> None:
    if block.toml is not None:
        (tmp_path / "monitor.toml").write_text(block.toml)
    code = block.code
    ns = _prelude(code)
    guard_before = ns["guard"]
    exec(compile(code, str(block.page), "exec"), ns)  # our own docs
    guard = ns.get("guard")
    if guard is not None and guard is not guard_before:  # the snippet attached its own guard
        assert guard.step_count > 0 and guard.stopped is None
        assert all(math.isfinite(v) or k.startswith(("stability/score/", "stability/clip"))
                   for k, v in guard.metrics().items())
    if "d" in ns and hasattr(ns["d"], "control"):
        assert ns["d"].step == ns["step"]


@pytest.mark.parametrize("block", TOML, ids=[b.where for b in TOML])
def test_toml_snippet_is_a_valid_config(block: Block) -> None:
    from stability.config.config import MonitorConfig

    MonitorConfig.from_toml(block.code)


def test_printed_output_is_compared_with_tolerance_only_on_decimals() -> None:
    assert _same_line("step 200: loss 0.0710", "step 200: loss 0.0712")
    assert not _same_line("step 200: loss 0.0710", "step 201: loss 0.0710")
    assert not _same_line("loss 0.0710", "loss 0.0810")
    assert not _same_line("LR factor 0.01 until changed", "LR factor 0.01 for 50 steps")
