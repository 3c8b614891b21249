"""``watch`` hooks fire once per intervention (issue 26, item 4): the stop the monitor keeps
asking for on every step the job still logs runs the stop hook once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.reader import read_run
from replay.watch import Watcher

RUN = Path(__file__).resolve().parents[2] / "data" / "runs" / "overfit"


def _jsonl(path: Path) -> None:
    cols = read_run(str(RUN)).to_pydict()
    steps = cols.pop("step")
    with path.open("w") as fh:
        for i, s in enumerate(steps):
            fh.write(json.dumps({"step": int(s), **{k: v[i] for k, v in cols.items()
                                                   if v[i] is not None}}) + "\n")


def test_stop_hook_fires_once_per_stop(tmp_path: Path) -> None:
    if not RUN.exists():
        pytest.skip("data/runs not in this checkout")
    log, out = tmp_path / "train.jsonl", tmp_path / "hooks.txt"
    _jsonl(log)
    w = Watcher([str(log)], "default", echo=None,
                hooks={"stop": f"echo $STABILITY_STEP >> {out}"})
    decisions = w.poll() + w.flush()
    w.hook_runner.finish(30.0)  # hooks run in the background: wait for them (as --once does)
    stops = [d.step for d in decisions for i in d.interventions if i.type == "stop"]
    assert len(stops) == 1  # a stop is decided once, also when the log goes on past it
    assert any(d.step > stops[0] for d in decisions)
    assert out.read_text().split() == [str(stops[0])]
    state = w.state_dict()
    assert state["stop_hooked"] == stops[0]
    w.close()
