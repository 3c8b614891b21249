"""``stability tune -o`` writes a complete config (issue 26, item 2).

The tuned file is the base preset plus the tuned overrides: it replays every binding of its
preset, and its header says what changed and what was kept.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from replay.labels import RunLabel
from replay.tuning import preset_of, tune_scores, write_config
from replay.tuning_scores import Candidate, RunScores
from stability.config.config import load_config
from stability.monitor.monitor import Monitor

DATA = Path(__file__).resolve().parents[2] / "data"


def _synthetic(base: dict) -> tuple[list[RunScores], list[Candidate], dict[str, RunLabel]]:
    """One tunable binding (``loss_spike``) whose score separates the faulty runs."""
    rng = np.random.default_rng(0)
    b = next(i for i, d in enumerate(base["detectors"]) if d["name"] == "loss_spike")
    scores, labels = [], {}
    for i in range(20):
        rid = f"r{i}"
        s = rng.normal(0, 1, 600)
        if i % 2:
            s[300:305] += 8.0
            labels[rid] = RunLabel(rid, "spike", 300, None, "degraded")
        else:
            labels[rid] = RunLabel(rid)
        scores.append(RunScores(rid, np.arange(600), [s]))
    d = base["detectors"][b]
    params = tuple(sorted({**{k: v for k, v in d["params"].items() if k != "threshold"},
                           "freeze_on_alarm": False}.items()))
    cands = [Candidate(b, d["name"], d["detector"], tuple(d["inputs"]), params, True)]
    return scores, cands, labels


@pytest.mark.parametrize("preset", ["default", "small"])
def test_tuned_file_replays_every_binding_of_its_preset(preset: str, tmp_path: Path) -> None:
    resolved = load_config(preset)
    base = resolved.to_dict()
    scores, cands, labels = _synthetic(base)
    res = tune_scores(scores, cands, labels, base, 2.0, folds=0, n_thresholds=200,
                      preset=preset_of(resolved), search="greedy")
    assert [c["binding"] for c in res.choices] == ["loss_spike"]
    out = tmp_path / "tuned.toml"
    write_config(out, res.file_config(), res.header())
    text = out.read_text()
    assert f'preset = "{preset}"' in text
    tuned = load_config(str(out))
    names = [d.name for d in resolved.detectors]
    assert [d.name for d in tuned.detectors] == names  # every binding of the preset
    for old, new in zip(resolved.detectors, tuned.detectors, strict=True):
        if old.name == "loss_spike":
            assert new.params["threshold"] == res.config["detectors"][names.index(
                "loss_spike")]["params"]["threshold"] != old.params["threshold"]
            assert new.params["freeze_on_alarm"] is False
        else:
            assert new == old, old.name
    mon = Monitor(str(out))  # and a monitor runs every binding of it
    assert [b.name for b in mon.config.detectors] == names
    # the header lists what changed (threshold before -> after) and what was kept
    head = [ln for ln in text.splitlines() if ln.startswith("#")]
    kind = resolved.detectors[names.index("loss_spike")].detector  # the preset's detector
    assert any(ln.startswith(f"# changed: loss_spike ({kind}): threshold ") for ln in head)
    kept = next(ln for ln in head if ln.startswith("# kept: "))
    assert set(kept[len("# kept: "):].split(", ")) == set(names) - {"loss_spike"}


def test_warm_search_that_moves_nothing_writes_the_preset(tmp_path: Path) -> None:
    """From the preset, a threshold that already detects every fault is not moved: the file is
    the preset line alone, and its header says nothing changed."""
    resolved = load_config("default")
    base = resolved.to_dict()
    scores, cands, labels = _synthetic(base)
    res = tune_scores(scores, cands, labels, base, 2.0, folds=0, n_thresholds=200,
                      preset="default")
    assert res.train.recall == 1.0  # the preset's threshold already catches every fault
    assert [(c["binding"], c["moved"]) for c in res.choices] == [("loss_spike", False)]
    assert res.file_config() == {"preset": "default", "detectors": []}
    assert "changed: nothing" in res.header()
    write_config(tmp_path / "t.toml", res.file_config(), res.header())
    assert load_config(str(tmp_path / "t.toml")).to_dict() == base


def test_a_config_of_its_own_is_written_whole(tmp_path: Path) -> None:
    src = {"preset": "small", "detectors": [{"name": "loss_spike", "params": {"warmup": 7}}]}
    resolved = load_config(src)
    assert preset_of(resolved) is None  # not the preset: its own overrides must survive
    base = resolved.to_dict()
    scores, cands, labels = _synthetic(base)
    res = tune_scores(scores, cands, labels, base, 2.0, folds=0, n_thresholds=200)
    write_config(tmp_path / "t.toml", res.file_config(), res.header())
    tuned = load_config(str(tmp_path / "t.toml"))
    assert [d.name for d in tuned.detectors] == [d.name for d in resolved.detectors]
    spike = next(d for d in tuned.detectors if d.name == "loss_spike")
    assert spike.params["warmup"] == 7 and math.isfinite(spike.params["threshold"])


def test_cli_tune_then_replay_keeps_the_overfit_stop(tmp_path: Path, capsys) -> None:
    """The issue's repro: the tuned config must still stop the bundled overfit run."""
    if not (DATA / "runs" / "overfit").exists():
        pytest.skip("data/runs not in this checkout")
    from replay.cli import main
    from replay.replay import replay_run

    out = tmp_path / "tuned.toml"
    assert main(["tune", str(DATA / "runs"), "--labels", str(DATA / "labels.parquet"),
                 "--budget", "5", "--folds", "0", "-o", str(out)]) == 0
    capsys.readouterr()
    default = replay_run(DATA / "runs" / "overfit", "default")
    tuned = replay_run(DATA / "runs" / "overfit", str(out))
    stops = [min(i.step for i in r.interventions if i.type == "stop") for r in (default, tuned)
             if any(i.type == "stop" for i in r.interventions)]
    assert len(stops) == 2 and stops[0] == stops[1]
