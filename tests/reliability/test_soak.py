"""CI-size soak (long flag only): 200k ``observe()`` steps with flat memory.

The full 10M-step soak is ``python benchmarks/bench_soak.py`` (see its docstring).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"


@pytest.mark.slow
def test_soak_200k_steps_memory_flat(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    code = mod.run(200_000, 24, 50_000, True, 4.0, "/dev/null" if Path("/dev/null").exists()
                   else str(BENCH.parent / "soak-events.jsonl"))
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
