"""The CLI takes every input kind replay reads, and says so when no metric binds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from replay.importers.tensorboard import write_scalar_events
from replay.replay import discover_runs


def _lightning_tb(d: Path, spike: int = 60) -> Path:
    """A Lightning-style TensorBoard run: ``train_loss_step``, ``lr-AdamW``."""
    d.mkdir(parents=True, exist_ok=True)
    write_scalar_events(d / "events.out.tfevents.1.host", [
        (s, {"train_loss_step": 40.0 if s == spike else 2.0 + 0.01 * (s % 3), "lr-AdamW": 1e-3})
        for s in range(100)])
    return d


def _replay_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> list[dict]:
    assert main(["replay", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_a_tensorboard_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    tb = _lightning_tb(tmp_path / "version_0")
    [s] = _replay_json([str(tb)], capsys)
    assert s["run_id"] == "version_0" and s["n_steps"] == 100
    assert s["first_alarm"]["step"] == 60 and s["first_alarm"]["signal"] == "loss"


def test_replay_a_file_uri(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tb = _lightning_tb(tmp_path / "tb", spike=70)
    [s] = _replay_json(["file://" + str(tb)], capsys)
    assert s["first_alarm"]["step"] == 70
    log = tmp_path / "train.jsonl"
    log.write_text("".join(json.dumps({"step": i, "train/loss": 50.0 if i == 40 else 2.0})
                           + "\n" for i in range(80)))
    [s] = _replay_json(["file://" + str(log)], capsys)
    assert s["run_id"] == "train" and s["first_alarm"]["step"] == 40


def test_a_directory_of_runs_in_several_formats(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    _lightning_tb(runs / "tb_run" / "lightning_logs")
    (runs / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 2.0}) + "\n" for i in range(30)))
    (runs / "notes.md").write_text("not a run")
    assert discover_runs(runs) == [("metrics", str(runs / "metrics.jsonl")),
                                   ("tb_run", str(runs / "tb_run"))]
    out = _replay_json([str(runs)], capsys)
    assert [s["run_id"] for s in out] == ["metrics", "tb_run"]
    assert [s["run_id"] for s in _replay_json([str(runs / "*")], capsys)] == [
        "metrics", "tb_run"]


def test_no_runs_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stability replay: error: no runs found") and "Traceback" not in err


def test_warning_when_no_metric_binds(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    log = tmp_path / "odd.jsonl"
    log.write_text("".join(json.dumps({"step": i, "trn_lss": 2.0, "gradnorm_total": 1.0})
                           + "\n" for i in range(30)))
    assert main(["replay", str(log)]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "no metric bound" in x)
    assert line.startswith("stability replay: warning:")
    assert "trn_lss" in line and "gradnorm_total" in line  # the names seen
    assert "~ train_loss (-> loss)" in line  # the closest alias
    # a run whose loss binds gives no such warning
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"step": i, "loss": 2.0}) + "\n" for i in range(30)))
    assert main(["replay", str(good)]) == 0
    assert "no metric bound" not in capsys.readouterr().err


def test_watch_warns_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "odd.jsonl"
    log.write_text("".join(json.dumps({"step": i, "trn_lss": 2.0}) + "\n" for i in range(30)))
    assert main(["watch", str(log), "--once"]) == 0
    assert "stability watch: warning:" in capsys.readouterr().err


def test_unknown_preset_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tb = _lightning_tb(tmp_path / "tb")
    for cmd in (["replay", str(tb), "-c", "nopreset"], ["watch", str(tb), "--once", "-c",
                                                        "nopreset"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "unknown preset 'nopreset'" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    rc = main(["report", "-c", "nopreset", str(tb), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "nopreset" in err
