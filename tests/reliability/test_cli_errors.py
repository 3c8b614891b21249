"""The CLI's one error path: every user error is one line naming the file, exit status 2.

``replay.cli.main`` is called in-process; ``--debug`` adds the traceback.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.cli import main


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A short run whose loss explodes: replaying it produces alarms (events to write)."""
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.01 * rng.standard_normal(300)
    loss[250:] = 1e6
    p = tmp_path / "spiky.parquet"
    pq.write_table(pa.table({"step": np.arange(300), "loss": loss}), p)
    return p


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], name: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"stability {argv[0]}: error: "), err
    assert name in lines[0], f"error does not name {name!r}: {lines[0]}"
    return lines[0]


def _files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, the argument kind): run files and config files that are user errors."""
    out: dict[str, tuple[Path, str]] = {}
    p = tmp / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array([0, 1]), pa.array([1.0, 2.0]),
                                         pa.array([3.0, 4.0])], names=["step", "a", "a"]), p)
    out["dup_parquet"] = (p, "run")
    p = tmp / "dup.csv"
    p.write_text("step,a,a\n0,1,2\n")
    out["dup_csv"] = (p, "run")
    p = tmp / "deep.jsonl"
    p.write_text('{"step": 0, "a": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    out["deep_jsonl"] = (p, "run")
    p = tmp / "latin.csv"
    p.write_bytes("step,\xe9\n0,1\n".encode("latin-1"))
    out["latin_csv"] = (p, "run")
    p = tmp / "huge.jsonl"
    p.write_text('{"step": 0, "a": 1' + "0" * 5000 + "}\n")
    out["huge_int_jsonl"] = (p, "run")
    p = tmp / "f300.csv"
    p.write_text("step,a\n0,1\n1e300,2\n")
    out["float_step_1e300"] = (p, "run")
    p = tmp / "u64.parquet"
    pq.write_table(pa.table({"step": pa.array([0, 2**64 - 1], pa.uint64()), "a": [1.0, 2.0]}), p)
    out["uint64_step"] = (p, "run")
    p = tmp / "junk.log"
    p.write_bytes(b"\x00" * 1000 + b"\nnot a megatron line\n")
    out["megatron_no_lines"] = (p, "run")
    p = tmp / "latin.toml"
    p.write_bytes("# caf\xe9\n".encode("latin-1"))
    out["latin_toml"] = (p, "config")
    p = tmp / "hist.toml"
    p.write_text('[[detectors]]\nname="h"\ndetector="histogram_drift"\ninputs=["loss"]\n'
                 "params={window=1000000000}\n")
    out["histogram_window_1e9"] = (p, "config")
    p = tmp / "bad.toml"
    p.write_text("[monitor\n")
    out["invalid_toml"] = (p, "config")
    p = tmp / "huge.json"
    p.write_text('{"monitor": {"x": 1' + "0" * 5000 + "}}")
    out["huge_int_config"] = (p, "config")
    return out


CASES = ["dup_parquet", "dup_csv", "deep_jsonl", "latin_csv", "huge_int_jsonl",
         "float_step_1e300", "uint64_step", "megatron_no_lines", "latin_toml",
         "histogram_window_1e9", "invalid_toml", "huge_int_config"]


@pytest.mark.parametrize("case", CASES)
def test_user_error_is_one_line_naming_the_file(tmp_path: Path, run: Path, case: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, kind = _files(tmp_path)[case]
    argv = ["replay", str(path)] if kind == "run" else ["replay", str(run), "-c", str(path)]
    one_line_error(capsys, argv, path.name)


def test_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, ["replay", str(tmp_path / "nope.parquet")], "nope.parquet")


def test_events_under_a_file(tmp_path: Path, run: Path, capsys: pytest.CaptureFixture[str]
                             ) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    one_line_error(capsys, ["replay", str(run), "--events", str(blocker / "ev.jsonl")],
                   "ev.jsonl")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_events_on_a_full_disk(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, ["replay", str(run), "--events", "/dev/full"], "/dev/full")
    assert "not a regular file" in line  # a device is never an events file of ours


def test_events_in_a_read_only_directory(tmp_path: Path, run: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if (ro / "probe").exists() or _writable(ro):
            pytest.skip("running as root: permissions are not enforced")
        one_line_error(capsys, ["replay", str(run), "--events", str(ro / "ev.jsonl")],
                       "ev.jsonl")
    finally:
        ro.chmod(0o755)


def _writable(d: Path) -> bool:
    try:
        (d / "probe").write_text("")
    except OSError:
        return False
    (d / "probe").unlink()
    return True


def test_bad_option_exits_2(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["replay", str(run), "--jobs", "many"])
    assert e.value.code == 2
    assert "--jobs" in capsys.readouterr().err


def test_unknown_preset_exits_2(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, ["replay", str(run), "-c", "no_such_preset"], "no_such_preset")


def test_debug_prints_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "dup.csv"
    p.write_text("step,a,a\n0,1,2\n")
    assert main(["replay", str(p), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "RunFormatError" in err
    assert err.strip().splitlines()[-1].startswith("stability replay: error: ")


def test_good_run_still_exits_0(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(run)]) == 0
    assert "spiky" in capsys.readouterr().out
