"""An HF fp16 run's own log replays as the run decided (issue 26, leftover).

A step the ``GradScaler`` skipped (an overflow: the loss is fine, the update did not happen) is
information, not an instability: live, the guard gives the monitor no gradient norm for it and
reports ``amp_overflow`` / ``loss_scale``.  The callback's log used to carry ``grad_norm = NaN``
on such a step, and a replay of ``trainer_state.json`` answered with critical ``nonfinite``
alarms, skips and LR cuts the run never had.  Overflows that *persist* are a real signal
(updates that never happen) and must be seen by both.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from replay.replay import replay_run  # noqa: E402
from stability.adapters.hf import StabilityTrainerCallback  # noqa: E402
from stability.monitor.monitor import Monitor  # noqa: E402

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "field_hf.py"
if "field_hf" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("field_hf", _PATH)
    assert _spec is not None and _spec.loader is not None
    sys.modules["field_hf"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["field_hf"])
field_hf = sys.modules["field_hf"]

#: The monitor inputs an HF log carries (the rest -- per-layer norms, update ratios -- only
#: the live guard sees).
LOGGED = ("loss", "grad_norm", "lr", "amp_overflow", "loss_scale")


class _InfGrads(transformers.TrainerCallback):  # type: ignore[misc]
    """From HF step ``start`` on, every gradient is non-finite before the optimizer step: the
    scaler skips every step (an overflow storm with a finite loss)."""

    def __init__(self, model: Any, start: int) -> None:
        self.on = False
        for p in model.parameters():
            p.register_hook(lambda g: g * math.inf if self.on else g)
        self.start = start

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.on = state.global_step >= self.start


def _run(out: Path, steps: int, storm_at: int | None = None) -> tuple[Any, list[Any], Any]:
    """A guarded HF fp16 run (CPU GradScaler starting at 2**22: the first steps overflow),
    logged every step; returns the trainer, the live alarms and the callback."""
    torch.set_num_threads(1)
    model = field_hf.Net(0)
    args = field_hf.make_args(str(out), "fp16", 0)
    args.max_steps, args.logging_steps, args.save_steps = steps, 1, steps
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    mon = Monitor(field_hf.PRESET)
    live: list[Any] = []
    mon.on_alarm(live.append)
    cb = StabilityTrainerCallback(mon, log_keys="core")
    cbs = [cb] + ([_InfGrads(model, storm_at)] if storm_at is not None else [])
    tr = transformers.Trainer(model=model, args=args,
                              train_dataset=field_hf.Data(steps * field_hf.BATCH, 0),
                              optimizers=(opt, None), callbacks=cbs)
    tr.remove_callback(transformers.trainer_callback.PrinterCallback)
    tr.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22)
    tr.accelerator.native_amp = True
    tr.train()
    return tr, live, cb


def _rows(tr: Any) -> list[dict[str, Any]]:
    return [h for h in tr.state.log_history if "learning_rate" in h]


def _key(a: Any, offset: int = 0) -> tuple[int, str, str, str]:
    return (a.step + offset, a.kind, a.signal, a.detector)


def test_scaler_skipped_steps_replay_without_alarms(tmp_path: Path) -> None:
    tr, live, cb = _run(tmp_path, 40)
    g = cb.guard
    assert g.amp_overflows >= 3  # the scaler did skip steps
    rows = _rows(tr)
    over = [r for r in rows if r.get("amp_overflow") == 1.0]
    assert len(over) == g.amp_overflows  # each skipped step says so in the log ...
    assert all("grad_norm" not in r for r in over)  # ... with no gradient norm (not NaN)
    assert all(math.isfinite(v) for r in rows for k, v in r.items()
               if isinstance(v, float) and not k.startswith("stability/"))
    assert not [i for i in g.interventions if i.type != "alert"] and not live
    res = replay_run(tmp_path / f"checkpoint-{tr.state.global_step}" / "trainer_state.json")
    assert res.alarms == [] and [i for i in res.interventions if i.type != "alert"] == []


def test_an_overflow_storm_is_seen_alike_live_and_in_replay(tmp_path: Path) -> None:
    """Every step overflows from HF step 60 on: the live monitor alarms on the overflow rate;
    a replay of the log raises the same alarms on the same steps (HF's step = the guard's + 1),
    and no ``nonfinite`` alarm on a gradient norm in either."""
    tr, live, cb = _run(tmp_path, 110, storm_at=60)
    seen = sorted(_key(a, 1) for a in live if a.signal in LOGGED)
    assert any(k[2] == "amp_overflow" for k in seen)  # the storm is a signal live ...
    res = replay_run(tmp_path / f"checkpoint-{tr.state.global_step}" / "trainer_state.json")
    assert sorted(_key(a) for a in res.alarms) == seen  # ... and the same one in replay
    assert not any(a.kind == "nonfinite" for a in [*live, *res.alarms])
