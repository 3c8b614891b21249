"""Field matrix, Lightning: precision x fault x resume (``-k field`` selects it).

The cells are those of ``benchmarks/field_lightning.py`` (which prints the matrix with
overheads). Lightning itself does not resume a run bit for bit (the same run without the
callback ends 0.1% apart after ``ckpt_path=`` resume), so a resumed cell must make the *decisions*
of the uninterrupted run and end close to it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "field_lightning.py"
_spec = importlib.util.spec_from_file_location("field_lightning", _PATH)
assert _spec is not None and _spec.loader is not None
field_pl = importlib.util.module_from_spec(_spec)
sys.modules["field_lightning"] = field_pl
_spec.loader.exec_module(field_pl)

_RUNS: dict[tuple[str, str, bool], object] = {}
def _run(precision: str, fault: str, resume: bool):
    key = (precision, fault, resume)
    if key not in _RUNS:
        _RUNS[key] = field_pl.run(precision, fault, resume)
    return _RUNS[key]


def _events(run, since: int):
    return [(i.step, i.type, i.reason) for ph in run.phases for i in
            (ph.callback.guard.interventions if ph.callback.guard else []) if i.step >= since]


_CELLS = [pytest.param(p, f, r, id=f"{p}-{f}-{'resume' if r else 'no_resume'}")
          for p in field_pl.PRECISIONS for f in field_pl.FAULTS for r in (False, True)]


@pytest.mark.parametrize(("precision", "fault", "resume"), _CELLS)
def test_field_lightning(precision: str, fault: str, resume: bool) -> None:
    clean = _run(precision, "clean", False)
    res = _run(precision, fault, resume)
    cell = field_pl.summarize(res, clean.final_loss)
    assert cell["log_has_stability_keys"]
    assert cell["args_unchanged"]
    if resume:  # the monitor's state survived: the decisions of the uninterrupted run
        ref = _run(precision, fault, False)
        assert _events(res, field_pl.RESUME_AT) == _events(ref, field_pl.RESUME_AT)
        assert res.final_loss == pytest.approx(ref.final_loss, rel=0.02)
        g2 = res.phases[-1].callback.guard
        assert res.phases[-1].trainer.global_step == g2.step_count + g2.steps_lost
    if fault == "clean":
        assert cell["acting_interventions"] == 0
    else:
        assert cell["acting_interventions"] > 0
        ok = math.isfinite(cell["final_loss"]) and cell["final_loss"] <= 1.05 * clean.final_loss
        assert ok or (cell["stopped"] and cell["stop_reason"]), cell


def test_field_lightning_fp16_overflows_are_information() -> None:
    res = field_pl.run("fp16", "clean", False, init_scale=2.0**30)
    g = res.callback.guard
    assert g.scaler is not None and g.amp_overflows >= 3
    assert not any("nonfinite" in i.reason for i in g.interventions)
    assert not [i for i in g.interventions if i.type in ("skip_step", "rollback", "stop")]
    assert math.isfinite(res.final_loss)
