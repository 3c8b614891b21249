"""HF trainer_state.json importer on a real Trainer run and hostile files."""

from __future__ import annotations

import json
import math

import pytest

from replay.importers.hf_trainer import read_trainer_state
from replay.importers.tensorboard import read_tensorboard
from replay.schema import RunFormatError, read_metadata

from .fixtures import FIXTURES


def test_real_trainer_state():
    t = read_trainer_state(FIXTURES / "hf_run" / "trainer_state.json")
    assert t.column("step").to_pylist() == list(range(1, 13))
    for c in ("loss", "grad_norm", "lr", "epoch", "val_loss"):
        assert c in t.column_names
    assert t.column("val_loss").null_count == 9  # eval every 4 steps
    md = read_metadata(t.schema)["run"]
    assert md["global_step"] == 12 and md["format"] == "hf_trainer"
    # same numbers as the Trainer's own TensorBoard log of that run (float32 there)
    tb = read_tensorboard(FIXTURES / "hf_run" / "events.out.tfevents.hf")
    for ours, theirs in (
        ("loss", "train/loss"),
        ("val_loss", "eval/loss"),
        ("lr", "train/learning_rate"),
    ):
        a, b = t.column(ours).to_pylist(), tb.column(theirs).to_pylist()
        assert [x is None for x in a] == [x is None for x in b]
        assert [x for x in a if x is not None] == pytest.approx(
            [x for x in b if x is not None], rel=1e-6
        )


def test_checkpoint_directory_and_summary(tmp_path):
    state = {
        "global_step": 3,
        "log_history": [
            {
                "loss": 2.0,
                "learning_rate": 1e-3,
                "grad_norm": float("nan"),
                "epoch": 0.1,
                "step": 1,
            },
            {"loss": None, "step": 2, "note": "text", "nested": {"a": 1}},
            {"eval_loss": 2.5, "eval_accuracy": 0.3, "step": 2},
            {"train_runtime": 1.0, "train_loss": 1.9, "total_flos": 5.0, "epoch": 1.0, "step": 3},
        ],
    }
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.warns(
        UserWarning, match=r"skipped non-numeric log_history key\(s\) \['nested', 'note'\]"
    ):
        t = read_trainer_state(tmp_path)
    d = t.to_pydict()
    assert d["step"] == [1, 2]  # the summary entry is metadata, not a row
    assert math.isnan(d["grad_norm"][0]) and d["loss"] == [2.0, None]
    assert d["eval_accuracy"] == [None, 0.3]
    run = read_metadata(t.schema)["run"]
    assert run["train_loss"] == 1.9 and run["train_runtime"] == 1.0


@pytest.mark.parametrize(
    ("content", "msg"),
    [
        ("{not json", "invalid JSON"),
        ('{"foo": 1}', "no 'log_history' list"),
        ('{"log_history": [1]}', r"log_history\[0\] is not an object"),
        ('{"log_history": [{"loss": 1.0}]}', r"log_history\[0\] has no integer 'step'"),
        ('{"log_history": [{"loss": 1.0, "step": 1.5}]}', "no integer 'step': 1.5"),
        ('{"log_history": []}', "log_history holds no metrics"),
    ],
)
def test_bad_files(tmp_path, content, msg):
    p = tmp_path / "trainer_state.json"
    p.write_text(content)
    with pytest.raises(RunFormatError, match=msg) as e:
        read_trainer_state(p)
    assert str(p) in str(e.value)
