"""Field matrix, plain PyTorch (``-k field``): precision x fault x resume, really trained on CPU.

Each test trains one precision x fault twice -- straight through, and with a checkpoint + resume
into fresh objects at step 70 -- plus the unguarded run of the same fault (the fault must really
hurt an unprotected run).  The harness is ``benchmarks/field_torch.py`` (also printed by
``benchmarks/bench_field.py``).  What must hold:

* clean runs: no acting intervention, the same final loss as without the guard;
* faulty runs: a final held-out loss no worse than 5% above the clean run's, or a stop with a
  named cause;
* the resumed run takes exactly the decisions of the uninterrupted one (monitor state survives);
* the user's optimizer / scheduler / scaler settings are unchanged afterwards, and the logged
  ``guard.metrics()`` carry ``stability/*`` keys.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "field_torch.py"


def _harness():
    mod = sys.modules.get("field_torch")
    if mod is None:
        spec = importlib.util.spec_from_file_location("field_torch", _PATH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["field_torch"] = mod
        spec.loader.exec_module(mod)
    return mod


FAULTY = ("lr_x50", "nan_weight", "grad_explosion")


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
@pytest.mark.parametrize("fault", ("clean",) + FAULTY)
@pytest.mark.parametrize("precision", ("fp32", "fp16", "bf16"))
def test_field_torch(precision: str, fault: str) -> None:
    ft = _harness()
    straight = ft.run_cell(precision, fault, resume=False)
    resumed = ft.run_cell(precision, fault, resume=True)
    clean = straight["clean_final_loss"]
    assert math.isfinite(clean)
    for row in (straight, resumed):
        assert row["args_unchanged"], "the user's optimizer / scheduler / scaler settings changed"
        assert row["log_has_stability_keys"]
        if fault == "clean":
            assert row["acting_interventions"] == 0
            assert row["final_loss"] == pytest.approx(clean, rel=1e-6)
            assert not row["stopped"]
        elif row["stopped"]:
            assert row["stop_reason"]  # a named cause
        else:
            assert row["final_loss"] <= 1.05 * clean, (row["final_loss"], clean)
    # monitor state survives the resume: the same decisions, the same outcome
    assert resumed["decisions"] == straight["decisions"]
    assert resumed["stopped"] == straight["stopped"]
    assert resumed["stop_reason"] == straight["stop_reason"]
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-6, nan_ok=True)
    if fault != "clean":
        bare = ft.unguarded(precision, fault)
        assert not bare["final_loss"] <= 1.5 * clean, "the fault must hurt an unguarded run"
        assert straight["acting_interventions"] > 0


def test_field_fp16_exercises_the_scaler() -> None:
    """The fp16 cells really go through scaler overflow steps (start-up halvings)."""
    ft = _harness()
    row = ft.run_cell("fp16", "clean", resume=False)
    assert row["amp_overflows"] > 0 and row["acting_interventions"] == 0
