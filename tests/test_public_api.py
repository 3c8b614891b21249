"""The public API: what users construct and catch imports from the package roots, cheaply."""

from __future__ import annotations

import subprocess
import sys

import replay
import stability


def test_every_exported_name_resolves() -> None:
    for name in stability.__all__:
        assert getattr(stability, name) is not None, name
    for name in replay.__all__:
        assert callable(getattr(replay, name)), name


def test_import_stability_pulls_in_no_framework_and_no_arrow() -> None:
    code = ("import sys, stability; bad = [m for m in ('torch', 'pyarrow', 'lightning', "
            "'transformers', 'replay') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_config_errors_are_catchable_from_the_root() -> None:
    try:
        stability.load_config({"detectors": [
            {"name": "x", "detector": "ewma", "inputs": ["loss"]}]})
    except stability.ConfigError as exc:
        assert "did you mean 'ewma_z'" in str(exc)
    else:  # pragma: no cover - the config is invalid
        raise AssertionError("no ConfigError")
