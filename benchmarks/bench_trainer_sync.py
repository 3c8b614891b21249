"""Step time of the trainer callbacks on a GPU: no callback, ``sync="step"``, ``sync="deferred"``.

A GPT-2 built from a config (no download) trained on random tokens with the real HF ``Trainer``
or Lightning ``Trainer``, bf16 autocast, fused AdamW::

    python benchmarks/bench_trainer_sync.py                      # both frameworks
    python benchmarks/bench_trainer_sync.py hf --steps 120 --repeats 3
    python benchmarks/bench_trainer_sync.py --layers 12 --width 1024 --seq 512 --batch 32

Prints the median milliseconds per optimizer step over ``repeats`` runs of each mode (the modes
alternate), timed from step ``WARM`` to the end with one ``cuda.synchronize`` at each mark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

WARM = 20
VOCAB = 4096
SIZE = {"seq": 256, "batch": 16, "width": 512, "layers": 6}  # (command-line options)


def _gpt(seed: int = 0) -> Any:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SIZE["seq"],
                                  n_embd=SIZE["width"], n_layer=SIZE["layers"],
                                  n_head=SIZE["width"] // 64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SIZE["seq"]),
                         generator=torch.Generator().manual_seed(0))


def _callback(framework: str, mode: str) -> Any:
    from stability.monitor.monitor import Monitor

    if mode == "none":
        return None
    mon = Monitor("small", alert_sinks=[])
    if framework == "hf":
        from stability.adapters.hf import StabilityTrainerCallback

        return StabilityTrainerCallback(mon, sync=mode)
    from stability.adapters.lightning import StabilityCallback

    return StabilityCallback(mon, sync=mode, checkpoint_every=0, log_metrics=False,
                             clip_norm=1.0)  # (Lightning cannot clip for a fused optimizer)


def run_hf(mode: str, steps: int) -> float:
    import transformers

    marks: dict[str, float] = {}

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == WARM:
                torch.cuda.synchronize()
                marks["t0"] = time.perf_counter()

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            marks["t1"] = time.perf_counter()

    x = _tokens(steps * SIZE["batch"])
    data = [{"input_ids": t, "labels": t} for t in x]
    cb = _callback("hf", mode)
    with tempfile.TemporaryDirectory() as d:
        args = transformers.TrainingArguments(
            d, max_steps=steps, per_device_train_batch_size=SIZE["batch"], learning_rate=3e-4,
            max_grad_norm=1.0, logging_steps=50, save_strategy="no", report_to=[],
            disable_tqdm=True, bf16=True, optim="adamw_torch_fused", dataloader_pin_memory=True)
        tr = transformers.Trainer(model=_gpt(), args=args, train_dataset=data,
                                  callbacks=[Clock()] + ([cb] if cb is not None else []))
        tr.train()
    return 1e3 * (marks["t1"] - marks["t0"]) / (steps - WARM)


def run_lightning(mode: str, steps: int) -> float:
    import lightning as L

    marks: dict[str, float] = {}

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = _gpt()

        def training_step(self, batch: Any, idx: int) -> Any:
            (t,) = batch
            if self.global_step == WARM and "t0" not in marks:
                torch.cuda.synchronize()
                marks["t0"] = time.perf_counter()
            return self.gpt(input_ids=t, labels=t).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=True)

    tokens = torch.utils.data.TensorDataset(_tokens(steps * SIZE["batch"]))
    loader = torch.utils.data.DataLoader(tokens, batch_size=SIZE["batch"], pin_memory=True)
    cb = _callback("lightning", mode)
    with tempfile.TemporaryDirectory() as d:
        tr = L.Trainer(max_steps=steps, accelerator="gpu", devices=1, precision="bf16-mixed",
                       logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       default_root_dir=d, callbacks=[cb] if cb is not None else [])
        tr.fit(Lit(), loader)
    torch.cuda.synchronize()
    marks["t1"] = time.perf_counter()
    return 1e3 * (marks["t1"] - marks["t0"]) / (steps - WARM)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("frameworks", nargs="*", default=["hf", "lightning"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    for k, v in SIZE.items():
        p.add_argument(f"--{k}", type=int, default=v)
    a = p.parse_args(argv)
    SIZE.update({k: getattr(a, k) for k in SIZE})
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    modes = ("none", "step", "deferred")
    for fw in a.frameworks:
        run = run_hf if fw == "hf" else run_lightning
        run("step", WARM + 5)  # warm-up: kernels, Numba, allocator
        ms: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(a.repeats):
            for m in modes:
                ms[m].append(run(m, a.steps))
        print(f"{fw}: GPT-2 {SIZE['layers']}x{SIZE['width']}, seq {SIZE['seq']}, batch "
              f"{SIZE['batch']}, bf16, fused AdamW, {torch.cuda.get_device_name()}")
        for m in modes:
            med = statistics.median(ms[m])
            print(f"  {m:9s} {med:7.2f} ms/step  (runs: {', '.join(f'{v:.2f}' for v in ms[m])})")


if __name__ == "__main__":
    main()
