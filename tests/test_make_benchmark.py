"""The issue-14 detection benchmark: ``benchmarks/make_benchmark.py`` and ``bench_detection.py``.

Small and fast: tiny runs of the MLP (a few seconds each on one CPU thread); the new
architectures of :mod:`stability.testing.models` train for 60 steps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replay.labels import load_labels  # noqa: E402
from replay.reader import read_run  # noqa: E402
from replay.schema import read_metadata  # noqa: E402
from stability.testing.models import TASKS, make_schedule  # noqa: E402
from stability.testing.tinytrain import _FAULT_DEFAULTS, FAULT_KINDS, train_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


mb = _load("make_benchmark")
bd = _load("bench_detection")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_fault_grid_covers_every_fault_kind() -> None:
    assert set(mb.FAULT_GRID) == set(FAULT_KINDS) == set(_FAULT_DEFAULTS)
    assert set(mb.FAMILY) == set(FAULT_KINDS)


def test_plan_is_deterministic_and_balanced() -> None:
    a, b = mb.plan(24, 3, 300, 7), mb.plan(24, 3, 300, 7)
    assert a == b
    assert mb.plan(24, 3, 300, 8) != a
    kinds = [f.kind for _, faults, _ in a for f in faults]
    counts = {k: kinds.count(k) for k in FAULT_KINDS}
    assert max(counts.values()) - min(counts.values()) <= 1  # 72 slots over 13 kinds
    for _cfg, faults, ids in a:
        assert len(ids) == len(set(ids)) == 4
        for f in faults:
            assert 0.4 * 300 <= f.onset <= 0.65 * 300
            assert (f.duration == 0) == (f.persistence == "persistent")
    assert {c.arch for c, _, _ in a} == set(mb.ARCHS)
    assert {c.optimizer for c, _, _ in a} == set(mb.OPTIMIZERS)


def _config(**kw: object) -> object:
    base = dict(index=0, arch="mlp", optimizer="adamw", schedule="warmup_cosine",
                precision="fp32", seed=3, steps=80)
    base.update(kw)
    return mb.Config(**base)


def test_generation_is_deterministic(tmp_path: Path) -> None:
    cfg = _config(optimizer="sgd", schedule="step")
    fault = mb.Fault("grad_explosion", "severe", "transient", 40, 3, 1e5)
    digests = []
    for d in ("a", "b"):
        out = tmp_path / d
        out.mkdir()
        mb.train_one(cfg, fault, "r", out, 20)
        digests.append(mb.sha256(out / "r.parquet"))
    assert digests[0] == digests[1]
    table = read_run(tmp_path / "a" / "r.parquet")
    assert table.num_rows == 80
    md = read_metadata(table.schema)
    assert md is not None and md["run"]["fault"]["kind"] == "grad_explosion"


def test_labels_against_the_counterfactual(tmp_path: Path) -> None:
    cfg = _config(precision="bf16")
    faults = [mb.Fault("lr_blowup", "severe", "persistent", 40, 0, 100.0),
              mb.Fault("bit_flip", "mild", "transient", 45, 1, 20.0)]
    ids = ["c", "f1", "f2"]
    rows = mb.run_config((cfg, faults, ids, str(tmp_path), 20))
    rows[0].pop("seconds")
    clean, blow, flip = rows
    assert clean["scenario"] == "clean" and clean["onset_step"] is None
    assert clean["outcome"] == "clean"
    for r, f in ((blow, faults[0]), (flip, faults[1])):
        assert r["onset_step"] == f.onset and r["prefix_identical"] is True
        for k in ("effect_step", "signal_effect_step", "divergence_step", "failure_step",
                  "nan_step"):
            assert r[k] is None or r[k] >= f.onset
    # x100 LR for good breaks the run; a low exponent bit flip does nothing visible
    assert blow["outcome"] in ("degraded", "diverged") and blow["effect_step"] is not None
    assert flip["outcome"] == "recovered" and flip["effect_step"] is None
    mb.write_labels(tmp_path, rows)
    for name in ("labels.parquet", "labels.json"):
        labels = load_labels(tmp_path / name)
        assert labels["c"].is_clean and not labels["f1"].is_clean
        assert labels["f1"].visible and not labels["f2"].visible
        assert labels["f1"].extra["model"] == "mlp"


@pytest.mark.parametrize("arch", sorted(TASKS))
def test_new_architectures_train(arch: str) -> None:
    res = train_run(arch, 60, seed=0, eval_every=0, schedule="constant")
    losses = np.asarray(res.losses)
    assert np.all(np.isfinite(losses))
    assert losses[-10:].mean() < losses[:10].mean() - 0.5


@pytest.mark.parametrize("precision,optimizer", [("bf16", "rmsprop"), ("fp16", "sgd"),
                                                  ("fp32", "adagrad")])
def test_precisions_and_optimizers_train(precision: str, optimizer: str) -> None:
    res = train_run("mlp", 60, seed=1, eval_every=0, precision=precision, optimizer=optimizer,
                    schedule="linear")
    losses = np.asarray(res.losses)
    assert np.all(np.isfinite(losses))
    assert losses[-10:].mean() < losses[:10].mean()


def test_fp16_overflow_is_skipped_by_the_grad_scaler(tmp_path: Path) -> None:
    cfg = _config(precision="fp16", steps=60)
    fault = mb.Fault("fp16_overflow", "moderate", "transient", 30, 5, math.inf)
    table = mb.train_one(cfg, fault, "r", tmp_path, 20)
    loss = np.asarray(table.column("loss").to_numpy(zero_copy_only=False), dtype=np.float64)
    assert np.all(np.isfinite(loss))  # the scaler skipped the inf steps: no NaN weights
    assert "amp_overflow" in table.column_names


def test_schedules() -> None:
    for name in ("warmup_cosine", "constant", "step", "linear"):
        f = make_schedule(name, 100)
        assert 0.0 < min(f(s) for s in range(100)) <= max(f(s) for s in range(100)) <= 1.0
    with pytest.raises(ValueError, match="schedule"):
        make_schedule("exp", 10)


def test_bench_detection_on_a_quick_set(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "set"
    assert mb.main(["--quick", "--only", "0", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert len([f for f in manifest["files"] if f.startswith("runs/")]) == 4
    for rel, digest in manifest["files"].items():
        assert mb.sha256(out / rel) == digest
    labels = (out / "labels.json").read_text()
    assert mb.main(["--quick", "--only", "0", "--out", str(out), "--labels-only"]) == 0
    assert (out / "labels.json").read_text() == labels  # re-derived from the recorded runs
    capsys.readouterr()
    js = tmp_path / "fig.json"
    assert bd.main(["--runs", str(out / "runs"), "--presets", "default,small", "--jobs", "1",
                    "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "per fault class" in text and "per model" in text
    doc = json.loads(js.read_text())
    assert set(doc["presets"]) == {"default", "small"}
    overall = doc["presets"]["default"]["overall"]
    assert overall["n_runs"] == 4 and overall["n_clean"] == 1 and overall["n_faulty"] == 3
    assert set(doc["presets"]["default"]["by"]["model"]) == {"mlp"}
