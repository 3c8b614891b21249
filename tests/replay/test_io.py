"""load_run: format detection and dispatch."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.io import detect_format, load_run
from replay.recorder import RunRecorder
from replay.schema import RunFormatError

from .fixtures import CHRONICLES, FIXTURES, need


@pytest.mark.parametrize(
    ("rel", "fmt"),
    [
        ("tb_torch", "tensorboard"),
        ("tb_torch/events.out.tfevents.torch", "tensorboard"),
        ("hf_run", "hf_trainer"),
        ("hf_run/trainer_state.json", "hf_trainer"),
        ("megatron_verbatim.log", "megatron"),
        ("wandb_history.csv", "csv"),
        ("wandb_history.jsonl", "jsonl"),
    ],
)
def test_detect_fixture_formats(rel, fmt):
    assert detect_format(FIXTURES / rel) == fmt


def test_detect_by_content(tmp_path):
    shutil.copy(FIXTURES / "megatron_verbatim.log", tmp_path / "slurm-1234")
    assert detect_format(tmp_path / "slurm-1234") == "megatron"
    pq.write_table(pa.table({"step": [0], "loss": [1.0]}), tmp_path / "noext")
    assert detect_format(tmp_path / "noext") == "parquet"
    (tmp_path / "state").write_text('{"log_history": []}')
    assert detect_format(tmp_path / "state") == "hf_trainer"
    (tmp_path / "rows.json").write_text('[{"step": 0}]')
    assert detect_format(tmp_path / "rows.json") == "json"
    (tmp_path / "mystery.bin").write_bytes(b"\x00\x01")
    with pytest.raises(RunFormatError, match="mystery.bin: unrecognised run format"):
        detect_format(tmp_path / "mystery.bin")
    with pytest.raises(RunFormatError, match="no such file"):
        detect_format(tmp_path / "missing")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(RunFormatError, match="no recognisable run files"):
        detect_format(tmp_path / "emptydir")
    with pytest.raises(RunFormatError, match="globs are supported for Parquet runs only"):
        detect_format(str(tmp_path / "*.log"))


def test_load_run_applies_aliases_everywhere():
    tb = load_run(FIXTURES / "hf_run" / "events.out.tfevents.hf")
    assert {"loss", "lr", "val_loss", "grad_norm"} <= set(tb.column_names)
    hf = load_run(FIXTURES / "hf_run", columns=["loss", "val_loss"])
    assert hf.column_names == ["step", "loss", "val_loss"]
    mg = load_run(FIXTURES / "megatron_verbatim.log", columns=["loss", "grad_norm", "loss_scale"])
    assert mg.column_names == ["step", "loss", "grad_norm", "loss_scale"]
    raw = load_run(FIXTURES / "tb_torch", default_aliases_=False)
    assert "train/loss" in raw.column_names
    opt = load_run(FIXTURES / "tb_torch", tags=["lr"])
    assert opt.column_names == ["step", "lr"]
    with pytest.raises(ValueError, match="format must be one of"):
        load_run(FIXTURES / "tb_torch", format="xml")


def test_load_recorded_run_and_uri(tmp_path):
    with RunRecorder(tmp_path / "r", part_steps=2) as rec:
        for s in range(5):
            rec.log(s, {"train/loss": 1.0})
    assert load_run(tmp_path / "r").column_names == ["step", "loss"]
    assert load_run(f"file://{tmp_path}/r").num_rows == 5
    assert load_run(str(tmp_path / "r" / "part-*.parquet"), columns=["loss"]).num_rows == 5
    shutil.copy(FIXTURES / "megatron_verbatim.log", tmp_path / "m.log")
    assert load_run(f"file://{tmp_path}/m.log").num_rows == 11


def test_chronicle_parquet_loads_directly():
    p = need(CHRONICLES / "tr11-176B_BLOOM_first_loss_spike_31216.parquet")
    t = load_run(p, columns=["loss", "grad_norm"])
    assert t.column("grad_norm").to_pylist()[5] == 960.351
