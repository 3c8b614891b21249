"""CSV / JSONL / JSON importers (W&B shapes) and hostile files."""

from __future__ import annotations

import math

import pytest

from replay.importers.tabular import read_csv, read_json, read_jsonl
from replay.schema import RunFormatError

from .fixtures import FIXTURES


def test_wandb_history_csv():
    with pytest.warns(UserWarning, match=r"dropped non-numeric column\(s\) \['run_name'\]"):
        t = read_csv(FIXTURES / "wandb_history.csv")
    d = t.to_pydict()
    assert d["step"] == [0, 1, 2, 3, 4]
    assert math.isnan(d["train/loss"][3]) and d["train/grad_norm"][3] == math.inf
    assert d["eval/loss"] == [None, None, None, None, 9.5]
    assert "_runtime" in d


def test_wandb_ui_export_csv():
    t = read_csv(FIXTURES / "wandb_ui_export.csv")
    d = t.to_pydict()
    assert t.column_names == ["step", "train/loss", "train/grad_norm"]
    assert d["step"] == [10, 20, 30]
    assert math.isnan(d["train/loss"][2]) and d["train/grad_norm"][1] is None


def test_wandb_jsonl():
    with pytest.warns(UserWarning, match=r"dropped non-numeric column\(s\) \['samples'\]"):
        t = read_jsonl(FIXTURES / "wandb_history.jsonl")
    d = t.to_pydict()
    assert d["step"] == [0, 1, 2, 3]
    assert math.isnan(d["train/loss"][1]) and d["train/loss"][3] == math.inf
    assert d["lr"][3] is None and d["eval/loss"] == [None, None, 3.0, None]


def test_step_column_choice_and_tsv(tmp_path):
    p = tmp_path / "run.tsv"
    p.write_text("_step\ttrainer/global_step\tloss\n0\t10\t1.0\n1\t20\t0.5\n")
    t = read_csv(p)
    assert t.column("step").to_pylist() == [10, 20] and "_step" in t.column_names
    t = read_csv(p, step_column="_step")
    assert t.column("step").to_pylist() == [0, 1]
    with pytest.raises(RunFormatError, match="step column 'nope' not found"):
        read_csv(p, step_column="nope")


def test_csv_hostile(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("step,loss\n0,1.0\n1,oops\n2,3.0\n")
    with pytest.raises(
        RunFormatError, match=r"bad.csv: column 'loss' holds non-numeric value 'oops' at row 1"
    ):
        read_csv(p)
    p.write_text("loss,lr\n1.0,0.1\n")
    with pytest.raises(RunFormatError, match="bad.csv: no step column"):
        read_csv(p)
    p.write_text("step,loss\n0,1.0\n1,2.0,3.0,4.0\n")
    with pytest.raises(RunFormatError, match="bad.csv: cannot parse CSV"):
        read_csv(p)
    p.write_text("step,loss\n0.5,1.0\n")
    with pytest.raises(RunFormatError, match="bad.csv: column 'step' must hold integers"):
        read_csv(p)
    p.write_text("step,name\n0,a\n")
    with (
        pytest.warns(UserWarning),
        pytest.raises(RunFormatError, match="no numeric metric columns"),
    ):
        read_csv(p)


def test_jsonl_hostile(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \n')
    with pytest.raises(RunFormatError, match=r"bad.jsonl: line 2: invalid JSON"):
        read_jsonl(p)
    p.write_text('{"step": 0, "loss": 1.0}\n[1, 2]\n')
    with pytest.raises(RunFormatError, match="line 2: expected a JSON object"):
        read_jsonl(p)
    p.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": "high"}\n')
    with pytest.raises(
        RunFormatError, match="line 2: column 'loss' holds non-numeric value 'high'"
    ):
        read_jsonl(p)
    p.write_text("\n\n")
    with pytest.raises(RunFormatError, match="empty file"):
        read_jsonl(p)


def test_json_variants(tmp_path):
    p = tmp_path / "rows.json"
    p.write_text('[{"step": 1, "loss": 2.0}, {"step": 0, "loss": NaN}]')
    d = read_json(p).to_pydict()
    assert d["step"] == [0, 1] and math.isnan(d["loss"][0])
    p.write_text('{"step": [0, 1], "loss": [1.0]}')
    with pytest.raises(RunFormatError, match="different lengths"):
        read_json(p)
    p.write_text('"just a string"')
    with pytest.raises(RunFormatError, match="expected a list of objects"):
        read_json(p)
    p.write_text("[]")
    with pytest.raises(RunFormatError, match="no rows"):
        read_json(p)
