"""The sample runs shipped in ``data/`` (made by ``data/make_samples.py``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.labels import load_labels
from replay.reader import read_run
from replay.schema import read_metadata

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
SCRIPT = DATA / "make_samples.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_samples", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_samples", mod)
    spec.loader.exec_module(mod)
    return mod


ms = _load_script()
NAMES = [s.name for s in ms.SAMPLES]
BY_NAME = {s.name: s for s in ms.SAMPLES}
LABELS = load_labels(DATA / "labels.parquet")


def _table(name: str) -> pa.Table:
    return read_run(DATA / "runs" / name)


def _col(t: pa.Table, name: str) -> np.ndarray:
    return np.asarray(t.column(name).to_numpy(zero_copy_only=False), dtype=np.float64)


def _run_info(name: str) -> dict[str, Any]:
    md = read_metadata(_table(name).schema)
    assert md is not None
    return dict(md["run"])


def _onset(name: str) -> int:
    lab = LABELS[name]
    assert lab.onset_step is not None
    return lab.onset_step


def _counterfactual(name: str) -> pa.Table:
    model = BY_NAME[name].model
    clean = next(s.name for s in ms.SAMPLES if s.model == model and s.fault is None)
    return _table(clean)


# ---------------------------------------------------------------------------- format
def test_every_sample_is_shipped() -> None:
    dirs = sorted(p.name for p in (DATA / "runs").iterdir() if p.is_dir())
    assert dirs == sorted(NAMES)
    for name in NAMES:
        parts = sorted((DATA / "runs" / name).glob("*.parquet"))
        assert parts and all(p.name.startswith("part-") for p in parts)


@pytest.mark.parametrize("name", NAMES)
def test_schema(name: str) -> None:
    t = _table(name)
    assert t.schema.field("step").type == pa.int64()
    for f in t.schema:
        if f.name != "step":
            assert f.type == pa.float64(), f.name
    steps = t.column("step").to_numpy()
    assert steps[0] == 0 and np.all(np.diff(steps) == 1)
    cols = set(t.column_names)
    assert {"loss", "lr", "grad_norm", "val_loss"} <= cols
    for fam in ("grad_norm", "update_ratio", "act_mean", "act_std", "act_absmax",
                "act_kurtosis"):
        assert any(c.startswith(fam + "/") for c in cols), fam
    # val_loss every eval_every steps, null in between
    info = _run_info(name)
    val = t.column("val_loss")
    logged = np.flatnonzero(~np.asarray(val.is_null()))
    assert len(logged) >= 1 and np.all(steps[logged] % info["eval_every"] == 0)


@pytest.mark.parametrize("name", NAMES)
def test_metadata(name: str) -> None:
    info = _run_info(name)
    s = BY_NAME[name]
    assert info["run_id"] == name and info["model"] == s.model
    assert info["scenario"] == s.scenario and info["generator"] == "data/make_samples.py"
    if s.fault is None:
        assert info["fault"] is None and info["onset_step"] is None
    else:
        assert info["fault"]["kind"] == s.fault
        assert info["fault"]["step"] == info["onset_step"] == _onset(name)


def test_labels_match_runs() -> None:
    assert sorted(LABELS) == sorted(NAMES)
    with open(DATA / "labels.json", encoding="utf-8") as fh:
        as_json = json.load(fh)
    assert as_json == pq.read_table(DATA / "labels.parquet").to_pylist()
    public = pq.read_schema(ROOT.parent / "shared/runs/public/labels.parquet") if (
        ROOT.parent / "shared/runs/public/labels.parquet").exists() else None
    ours = pq.read_schema(DATA / "labels.parquet")
    for c in ("run_id", "scenario", "onset_step", "end_step", "outcome", "divergence_step",
              "failure_step", "nan_step"):
        assert c in ours.names
        if public is not None:
            assert ours.field(c).type == public.field(c).type, c
    for name, lab in LABELS.items():
        s = BY_NAME[name]
        assert lab.scenario == s.scenario
        assert lab.is_clean == (s.fault is None)
        assert lab.outcome == "clean" if s.fault is None else lab.outcome != "clean"
        n = _table(name).num_rows
        for st in (lab.onset_step, lab.divergence_step, lab.failure_step, lab.nan_step):
            assert st is None or 0 <= st < n


@pytest.mark.parametrize("name", [s.name for s in ms.SAMPLES if s.fault is None])
def test_clean_runs_are_finite(name: str) -> None:
    t = _table(name)
    for c in t.column_names[1:]:
        logged = ~np.asarray(t.column(c).is_null().to_numpy(zero_copy_only=False), dtype=bool)
        assert logged.any() and np.all(np.isfinite(_col(t, c)[logged])), c
    for c in ("loss", "lr", "grad_norm"):
        assert t.column(c).null_count == 0, c
    loss = _col(t, "loss")
    assert np.all(np.isfinite(loss))
    assert loss[-20:].mean() < 0.8 * loss[:20].mean()  # it learns


@pytest.mark.parametrize("name", [s.name for s in ms.SAMPLES if s.fault is not None])
def test_identical_to_counterfactual_before_onset(name: str) -> None:
    t, cf, k = _table(name), _counterfactual(name), _onset(name)
    for c in ("loss", "grad_norm", "lr"):
        np.testing.assert_array_equal(_col(t, c)[:k], _col(cf, c)[:k])


# ---------------------------------------------------------------------------- faults visible
def _pre_median(t: pa.Table, k: int, col: str = "loss") -> float:
    return float(np.median(_col(t, col)[max(0, k - 50):k]))


def test_lr_blowup_visible() -> None:
    t, k = _table("lr_blowup"), _onset("lr_blowup")
    cf = _counterfactual("lr_blowup")
    lr, clr = _col(t, "lr"), _col(cf, "lr")
    assert lr[k] / clr[k] == pytest.approx(BY_NAME["lr_blowup"].magnitude)
    np.testing.assert_array_equal(lr[:k], clr[:k])
    loss = _col(t, "loss")
    after = loss[k:]
    ref = _pre_median(t, k)
    assert (not np.all(np.isfinite(after))) or np.nanmax(after) > 3 * ref
    lab = LABELS["lr_blowup"]
    assert lab.outcome == "diverged" and lab.divergence_step is not None
    upd = [c for c in t.column_names if c.startswith("update_ratio/")]
    assert max(np.nanmax(_col(t, c)[k:k + 20]) / np.nanmax(_col(t, c)[k - 50:k]) for c in upd) > 5


def test_corrupt_data_visible() -> None:
    t, k = _table("corrupt_data"), _onset("corrupt_data")
    dur = BY_NAME["corrupt_data"].duration
    loss, closs = _col(t, "loss"), _col(_counterfactual("corrupt_data"), "loss")
    assert loss[k] > 1.5 * closs[k]  # a garbage batch
    after = slice(k + dur, k + dur + 10)  # back on real data: the model was damaged
    assert loss[after].mean() > 1.2 * closs[after].mean()
    assert LABELS["corrupt_data"].outcome != "clean"


def test_bitflip_visible() -> None:
    t, k = _table("bitflip"), _onset("bitflip")
    loss = _col(t, "loss")
    assert np.all(np.isfinite(loss[:k]))
    assert (not np.isfinite(loss[k])) or loss[k] > 3 * _pre_median(t, k)
    lab = LABELS["bitflip"]
    assert lab.effect_step == k


def test_overfit_visible() -> None:
    t, k = _table("overfit"), _onset("overfit")
    cf = _counterfactual("overfit")
    val, cval = _col(t, "val_loss"), _col(cf, "val_loss")
    loss, closs = _col(t, "loss"), _col(cf, "loss")
    logged = np.flatnonzero(~np.isnan(val))
    last = logged[-1]
    assert last > k
    assert val[last] > 1.1 * cval[last]  # held-out loss rises against the clean run
    assert loss[-20:].mean() < 0.7 * closs[-20:].mean()  # training loss falls below it
    assert loss[-20:].mean() < 0.7 * val[last]  # the train/val gap opens
    assert LABELS["overfit"].outcome == "degraded"


def test_grad_explosion_visible() -> None:
    t, k = _table("grad_explosion"), _onset("grad_explosion")
    g = _col(t, "grad_norm")
    assert g[k] > 1000 * _pre_median(t, k, "grad_norm")


# ---------------------------------------------------------------------------- the generator
def test_derive_label_definitions() -> None:
    s = ms.Sample("x", "mlp", "lr_too_high", "lr_blowup", 0.5)
    steps = 100
    loss = np.full(steps, 1.0)
    loss[60:] = 10.0  # runaway from 60 to the end
    t = pa.table({"step": pa.array(np.arange(steps), pa.int64()), "loss": loss,
                  "val_loss": pa.array([None] * steps, pa.float64())})
    row = ms.derive_label("x", s, t, steps, t.set_column(1, "loss", pa.array(np.ones(steps))))
    assert row["onset_step"] == 50 and row["outcome"] == "diverged"
    assert row["divergence_step"] == 60 and row["failure_step"] == 60
    assert row["nan_step"] is None and row["effect_step"] == 60
    loss[60:80] = np.nan
    loss[80:] = 1.0
    t2 = t.set_column(1, "loss", pa.array(loss))
    row = ms.derive_label("x", s, t2, steps, t.set_column(1, "loss", pa.array(np.ones(steps))))
    assert row["nan_step"] == 60 and row["divergence_step"] == 60
    assert row["failure_step"] is None and row["outcome"] == "recovered"


def test_make_samples_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the generator trains real models
    out = tmp_path / "samples"
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", "30", "--jobs", "1",
           "--eval-every", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    labels = load_labels(out / "labels.parquet")
    assert sorted(labels) == sorted(NAMES)
    assert labels["grad_explosion"].onset_step == 15 and labels["clean"].is_clean
    t = read_run(out / "runs" / "grad_explosion")
    assert t.num_rows == 30 and t.schema.field("step").type == pa.int64()
    g = t.column("grad_norm").to_numpy()
    assert g[15] > 100 * np.median(g[:15])
    lr = read_run(out / "runs" / "lr_blowup").column("lr").to_numpy()
    clr = read_run(out / "runs" / "clean").column("lr").to_numpy()
    assert lr[15] == pytest.approx(100 * clr[15])
    assert not np.isfinite(read_run(out / "runs" / "bitflip").column("loss").to_numpy()[15])
