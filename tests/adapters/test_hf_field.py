"""Field matrix, HF Trainer: precision x fault x resume (``-k field`` selects it).

The cells are those of ``benchmarks/field_hf.py`` (which prints the matrix with overheads).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "field_hf.py"
_spec = importlib.util.spec_from_file_location("field_hf", _PATH)
assert _spec is not None and _spec.loader is not None
field_hf = importlib.util.module_from_spec(_spec)
sys.modules["field_hf"] = field_hf
_spec.loader.exec_module(field_hf)

_RUNS: dict[tuple[str, str, bool], object] = {}


def _run(precision: str, fault: str, resume: bool):
    key = (precision, fault, resume)
    if key not in _RUNS:
        _RUNS[key] = field_hf.run(precision, fault, resume)
    return _RUNS[key]


def _events(run, since: int):
    return [(i.step, i.type) for ph in run.phases for i in
            (ph.callback.guard.interventions if ph.callback.guard else []) if i.step >= since]


@pytest.mark.parametrize("resume", [False, True], ids=["no_resume", "resume"])
@pytest.mark.parametrize("fault", field_hf.FAULTS)
@pytest.mark.parametrize("precision", field_hf.PRECISIONS)
def test_field_hf(precision: str, fault: str, resume: bool) -> None:
    clean = _run(precision, "clean", False)
    res = _run(precision, fault, resume)
    cell = field_hf.summarize(res, clean.final_loss)
    assert cell["log_has_stability_keys"]
    assert cell["args_unchanged"]
    if fault == "clean":
        assert cell["acting_interventions"] == 0
    else:
        assert cell["acting_interventions"] > 0
        ok = math.isfinite(cell["final_loss"]) and cell["final_loss"] <= 1.05 * clean.final_loss
        assert ok or (cell["stopped"] and cell["stop_reason"]), cell
    if resume:
        # the monitor's state survived: same decisions and the same run as without the resume
        ref = _run(precision, fault, False)
        assert _events(res, field_hf.RESUME_AT) == _events(ref, field_hf.RESUME_AT)
        assert res.final_loss == pytest.approx(ref.final_loss, rel=1e-5)
        g2 = res.phases[-1].callback.guard
        assert res.phases[-1].trainer.state.global_step == g2.step_count + g2.steps_lost


@pytest.fixture(scope="module")
def overflowing():
    """fp16 with a start-up scale that overflows for the first steps (scaler-skipped)."""
    return field_hf.run("fp16", "clean", False, init_scale=2.0**22)


def test_field_hf_fp16_overflows_are_information(overflowing) -> None:
    g = overflowing.callback.guard
    assert g.scaler is not None and g.amp_overflows >= 3  # the scaler did skip steps
    # routine overflows are not critical nonfinite alarms (no response names one)
    assert not any("nonfinite" in i.reason for i in g.interventions)
    assert not [i for i in g.interventions if i.type in ("skip_step", "rollback", "stop")]
    assert math.isfinite(overflowing.final_loss)
    # HF's logged grad_norm is the unscaled pre-clip norm, not the one of the scaled gradients
    logged = [h["grad_norm"] for h in overflowing.trainer.state.log_history if "grad_norm" in h]
    finite = [v for v in logged if math.isfinite(v)]
    assert finite and max(finite) < 100.0


def test_field_hf_fp16_overflows_no_acting_interventions(overflowing) -> None:
    # HF does not step the scheduler on scaler-skipped steps: the warm-up LR is flat during the
    # start-up overflows, and its first ordinary increase afterwards must not read as an LR jump
    g = overflowing.callback.guard
    assert not [i for i in g.interventions if i.type != "alert"]

