"""Cold start: kernels compile lazily (only those a config uses), and ``stability warmup``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.cli import main
from stability.config.registry import detector_class

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from detectors import dispatch
from stability.monitor.monitor import Monitor
from stability.config.registry import detector_class
cfg = {"detectors": [{"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"]}]}
names = sys.argv[1:]
before = {n: len(detector_class(n).kernel.signatures) for n in names}
mon = Monitor(cfg)
built = {n: len(detector_class(n).kernel.signatures) for n in names}
for s in range(3):
    mon.observe(s, {"loss": 1.0 + s, "lr": 1e-3})
dispatch.wait_ready()  # a cold cache: the twin ran and the kernel was built aside
after = {n: len(detector_class(n).kernel.signatures) for n in names}
print(json.dumps({"before": before, "built": built, "after": after}))
"""


def test_only_the_kernels_a_config_uses_are_compiled() -> None:
    names = ["ewma_z", "page_hinkley", "robust_z", "activation_shift", "lr_jump"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _PROBE, *names], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    zero = dict.fromkeys(names, 0)
    assert got["before"] == zero  # importing detectors compiles nothing
    assert got["built"] == zero  # nor does building a monitor
    # observing compiles (or loads, now or in the background) exactly one specialisation of
    # the one kernel used
    assert got["after"] == {**zero, "ewma_z": 1}


def test_warmup_command_compiles_the_config_kernels(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"detectors": [
        {"name": "loss_spike", "detector": "ewma_z", "inputs": ["loss"]},
        {"name": "lr", "detector": "lr_jump", "inputs": ["lr"]}]}))
    assert main(["warmup", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "ewma_z" in out and "lr_jump" in out and "page_hinkley" not in out
    assert "warm: 2 detector kernels" in out
    for name in ("ewma_z", "lr_jump"):
        assert len(detector_class(name).kernel.signatures) == 1


_SAME_SPEC = """
import json
import numpy as np
from replay.cli import main
from stability.config.config import load_config
from stability.monitor.monitor import Monitor
from stability.config.registry import detector_class
assert main(["warmup", "--config", "small"]) == 0
used = sorted({spec.detector for spec in load_config("small").detectors})
mon = Monitor("small")
mon.declare_family("grad_norm", ["a", "b"])
for s in range(3):
    mon.observe(s, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "val_loss": 1.0},
                families={"grad_norm": np.ones(2)})
print(json.dumps({n: len(detector_class(n).kernel.signatures) for n in used}))
"""


def test_warmup_uses_the_monitor_specialisation() -> None:
    """After ``warmup`` a monitor adds no second specialisation of any kernel of the preset."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _SAME_SPEC], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert len(got) >= 5
    assert got == dict.fromkeys(got, 1)


def test_warmup_rejects_an_unknown_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup", "--config", "no_such_preset"]) == 2
    assert "stability warmup: error:" in capsys.readouterr().err
