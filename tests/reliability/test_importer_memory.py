"""Text importers stream: peak memory does not grow with the file size.

Each importer reads a *sparse* file (a few real rows, then a hole of NUL bytes -- what a crash
leaves on some file systems -- then a few more rows) in a child process that reports its own peak
RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) before and after the read.  The default set
uses 200 MB files and bounds the growth at 100 MB (reading the whole file, as the importers did
before issue 12, costs at least twice the file size); the long set (``STABILITY_LONG=1``) uses
1 GB files and bounds the child's whole peak RSS at 300 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, warnings
import pyarrow  # noqa: F401 -- imported before the baseline
from replay.importers import read_csv, read_jsonl, read_megatron_log
from replay.schema import RunFormatError
fmt, path = sys.argv[1], sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reader = {"jsonl": read_jsonl, "megatron": read_megatron_log, "csv": read_csv}[fmt]
out = {}
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = reader(path)
    out["steps"] = t.column("step").to_pylist()
except RunFormatError as e:
    out["error"] = str(e)
out["base_kib"] = base
out["peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(out))
"""

HEAD = {
    "jsonl": b'{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 1.9}\n',
    "megatron": b" iteration        0/     100 | lm loss: 2.0E+00 |\n"
                b" iteration        1/     100 | lm loss: 1.9E+00 |\n",
    "megatron_junk": b"[INFO] starting\n",
    "csv": b"step,loss\n0,2.0\n1,1.9\n",
}
TAIL = {
    "jsonl": b'\n{"step": 2, "loss": 1.8}\n',
    "megatron": b"\n iteration        2/     100 | lm loss: 1.8E+00 |\n",
    "megatron_junk": b"\n[INFO] done\n",
    "csv": b"\n2,1.8\n",
}


def _sparse(path: Path, head: bytes, size: int, tail: bytes) -> None:
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)  # a hole: reads as NUL bytes, costs no disk
        f.seek(size)
        f.write(tail)


def _run_child(fmt: str, path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, fmt, str(path)], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


CASES = ["jsonl", "megatron", "megatron_junk", "csv"]


def _check(tmp_path: Path, case: str, size: int) -> dict[str, object]:
    suffix = {"jsonl": ".jsonl", "csv": ".csv"}.get(case, ".log")
    p = tmp_path / f"big{suffix}"
    _sparse(p, HEAD[case], size, TAIL[case])
    fmt = "megatron" if case.startswith("megatron") else case
    out = _run_child(fmt, p)
    if case in ("jsonl", "megatron"):  # the NUL hole is a blank line: rows on both sides kept
        assert out.get("steps") == [0, 1, 2], out
    elif case == "megatron_junk":
        assert "no Megatron/DeepSpeed iteration lines" in str(out.get("error")), out
    else:  # a 200 MB CSV field of NULs: a clear error naming the file
        assert p.name in str(out.get("error")), out
    return out


@pytest.mark.parametrize("case", CASES)
def test_importers_stream_200mb(tmp_path: Path, case: str) -> None:
    out = _check(tmp_path, case, 200 << 20)
    growth_mib = (int(out["peak_kib"]) - int(out["base_kib"])) / 1024  # type: ignore[call-overload]
    assert growth_mib < 100, f"peak RSS grew by {growth_mib:.0f} MiB reading a 200 MB file"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_importers_stream_1gb(tmp_path: Path, case: str) -> None:
    out = _check(tmp_path, case, 1 << 30)
    peak_mib = int(out["peak_kib"]) / 1024  # type: ignore[call-overload]
    assert peak_mib < 300, f"peak RSS {peak_mib:.0f} MiB reading a 1 GB file"
