"""Hostile files: every reader fails with a clear error naming the file, never a raw traceback.

The accepted failure for a run file is :class:`replay.schema.RunFormatError` (a ``ValueError``)
whose message contains the file's name; for a config file,
:class:`stability.config.registry.ConfigError`
(also a ``ValueError``) naming the key path (and, for files, the file).  A read that succeeds
must not be a silent partial result: a recorded run reads completely or not at all; a TensorBoard
file with a torn last record (a live writer) may read the complete records but must warn naming
the file.  The importers and the config loader are fuzzed with hypothesis (bounded).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.importers import (
    read_csv,
    read_jsonl,
    read_megatron_log,
    read_tensorboard,
    read_trainer_state,
)
from replay.io import load_run
from replay.reader import read_run
from replay.recorder import RunRecorder
from replay.schema import RunFormatError
from stability.config.config import load_config
from stability.config.registry import ConfigError
from stability.outputs.events import EventLog, read_events

FIXTURES = Path(__file__).resolve().parents[1] / "replay" / "fixtures"
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def clear_error(fn: Callable[[], Any], path: Path | str, exc: type[Exception] = RunFormatError
                ) -> Exception:
    """``fn()`` must raise ``exc`` naming ``path``; returns the exception."""
    with pytest.raises(Exception) as info:  # the type is checked below
        fn()
    e = info.value
    assert isinstance(e, exc), f"{type(e).__name__} instead of {exc.__name__}: {e}"
    assert Path(path).name in str(e), f"error does not name the file: {e}"
    return e


def _recorded(tmp: Path, n: int = 300, part_steps: int = 100) -> Path:
    d = tmp / "run"
    rng = np.random.default_rng(0)
    with RunRecorder(d, part_steps=part_steps) as rec:
        for s in range(n):
            rec.log(s, {"loss": float(rng.random()), "grad_norm/blk0": float(rng.random())})
    return d


# ---------------------------------------------------------------------------- Parquet
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5, 0.9, 0.999])
def test_truncated_part_names_the_file(tmp_path: Path, frac: float) -> None:
    d = _recorded(tmp_path)
    part = d / "part-000001.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: int(len(data) * frac)])
    clear_error(lambda: read_run(d), part)


def test_foreign_junk_in_the_run_directory(tmp_path: Path) -> None:
    d = _recorded(tmp_path)
    (d / ".part-000003.parquet.1234.tmp").write_bytes(b"PAR1 half a part")  # killed writer
    assert read_run(d).num_rows == 300  # hidden temporary files are not parts
    (d / "part-000003.parquet").write_bytes(b"not parquet at all")
    clear_error(lambda: read_run(d), d / "part-000003.parquet")


@pytest.mark.parametrize("case", ["step_string", "no_step", "step_nulls", "metric_string",
                                  "type_clash", "step_float"])
def test_schema_mismatch(tmp_path: Path, case: str) -> None:
    d = _recorded(tmp_path)
    bad = d / "part-000003.parquet"
    tables = {
        "step_string": pa.table({"step": ["a", "b"], "loss": [1.0, 2.0]}),
        "no_step": pa.table({"loss": [1.0, 2.0]}),
        "step_nulls": pa.table({"step": pa.array([300, None], pa.int64()), "loss": [1.0, 2.0]}),
        "metric_string": pa.table({"step": [300, 301], "loss": ["x", "y"]}),
        "type_clash": pa.table({"step": [300, 301], "loss": pa.array([[1.0], [2.0]])}),
        "step_float": pa.table({"step": [300.5, 301.0], "loss": [1.0, 2.0]}),
        "bad_metadata": pa.table({"step": [300, 301], "loss": [1.0, 2.0]}).replace_schema_metadata(
            {b"stability": b"{not json"}),
    }
    pq.write_table(tables[case], bad)
    if case in ("metric_string", "type_clash"):
        # documented: a non-numeric metric column is dropped with a warning naming the file
        with pytest.warns(UserWarning, match=bad.name):
            t = read_run(d)
        assert t.num_rows == 302
        return
    clear_error(lambda: read_run(d), bad)


def test_bad_metadata_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "r.parquet"
    pq.write_table(pa.table({"step": [0, 1], "loss": [1.0, 2.0]}).replace_schema_metadata(
        {b"stability": b"{not json"}), p)
    clear_error(lambda: read_run(p), p)


@FUZZ
@given(data=st.data())
def test_fuzzed_parquet_is_all_or_error(tmp_path_factory: pytest.TempPathFactory,
                                        data: st.DataObject) -> None:
    tmp = tmp_path_factory.mktemp("fuzzpq")
    d = _recorded(tmp, n=120, part_steps=60)
    part = d / "part-000000.parquet"
    raw = bytearray(part.read_bytes())
    n_flips = data.draw(st.integers(1, 8))
    for _ in range(n_flips):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    part.write_bytes(bytes(raw))
    try:
        t = read_run(d)
    except RunFormatError as e:
        assert "part-000000.parquet" in str(e), str(e)
        return
    # read without error: must be exactly what was written (not silently altered or truncated)
    assert t.num_rows == 120 and t.column("step").to_pylist() == list(range(120))
    ref = read_run(_recorded(tmp_path_factory.mktemp("fuzzref"), n=120, part_steps=60))
    assert t.equals(ref)


# ---------------------------------------------------------------------------- TensorBoard
TB = FIXTURES / "tb_torch" / "events.out.tfevents.torch"


def _tb_copy(tmp: Path, data: bytes) -> Path:
    p = tmp / "tb" / "events.out.tfevents.fuzz"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


@FUZZ
@given(data=st.data())
def test_fuzzed_tensorboard(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    raw = bytearray(TB.read_bytes())
    full = read_tensorboard(TB)
    mode = data.draw(st.sampled_from(["truncate", "flip", "both"]))
    if mode in ("flip", "both"):
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if mode in ("truncate", "both"):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    p = _tb_copy(tmp_path_factory.mktemp("fuzztb"), bytes(raw))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t = read_tensorboard(p)
        except RunFormatError as e:
            assert p.name in str(e), str(e)
            return
    if t.num_rows != full.num_rows or mode != "truncate":
        # a shorter (or altered) result is only acceptable with a warning naming the file
        if not (t.equals(full)):
            assert any(p.name in str(w.message) for w in caught), "silent partial result"


# ---------------------------------------------------------------------------- trainer_state
TS = FIXTURES / "hf_run" / "trainer_state.json"


@pytest.mark.parametrize("text", [
    "", "null", "[]", "{}", '{"log_history": {}}', '{"log_history": [1, 2]}',
    '{"log_history": [{"step": "1", "loss": 1.0}]}',
    '{"log_history": [{"step": 1.5, "loss": 1.0}]}',
    '{"log_history": [{"step": 1, "loss": "abc"}]}',
    '{"log_history": [{"step": 1e400, "loss": 1.0}]}',
    '{"log_history": [{"step": -5, "loss": 1.0}]}',
    "\x00\x01garbage",
], ids=lambda s: repr(s[:24]))
def test_bad_trainer_state(tmp_path: Path, text: str) -> None:
    p = tmp_path / "trainer_state.json"
    p.write_text(text)
    try:
        t = read_trainer_state(p)
    except RunFormatError as e:
        assert p.name in str(e)
        return
    assert t.num_rows >= 0  # accepted: must at least be a valid table


@pytest.mark.parametrize("text", [
    f'{{"log_history": [{{"step": {10**30}, "loss": 1.0}}]}}',
    '{"log_history": ' + "[" * 100_000 + "]" * 100_000 + "}",
], ids=["huge_int_step", "deeply_nested"])
def test_trainer_state_extremes(tmp_path: Path, text: str) -> None:
    p = tmp_path / "trainer_state.json"
    p.write_text(text)
    clear_error(lambda: read_trainer_state(p), p)


@FUZZ
@given(data=st.data())
def test_fuzzed_trainer_state(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
                              ) -> None:
    text = TS.read_text()
    mode = data.draw(st.sampled_from(["truncate", "splice", "values"]))
    if mode == "truncate":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif mode == "splice":
        i = data.draw(st.integers(0, len(text)))
        text = text[:i] + data.draw(st.text(max_size=20)) + text[i:]
    else:
        doc = json.loads(text)
        hist = doc.get("log_history", [])
        if hist:
            entry = hist[data.draw(st.integers(0, len(hist) - 1))]
            key = data.draw(st.sampled_from(sorted(entry)))
            entry[key] = data.draw(st.one_of(
                st.none(), st.booleans(), st.text(max_size=5), st.floats(),
                st.integers(-2**62, 2**62), st.lists(st.integers(), max_size=2)))
        text = json.dumps(doc)
    p = tmp_path_factory.mktemp("fuzzts") / "trainer_state.json"
    p.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped keys are reported by warnings (checked elsewhere)
        try:
            read_trainer_state(p)
        except RunFormatError as e:
            assert p.name in str(e), str(e)


# ---------------------------------------------------------------------------- Megatron
MG = FIXTURES / "megatron_verbatim.log"


@FUZZ
@given(data=st.data())
def test_fuzzed_megatron_log(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
                             ) -> None:
    raw = bytearray(MG.read_bytes()[:20_000])
    for _ in range(data.draw(st.integers(0, 10))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    p = tmp_path_factory.mktemp("fuzzmg") / "train.log"
    p.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            read_megatron_log(p)
        except RunFormatError as e:
            assert p.name in str(e), str(e)


def test_megatron_huge_iteration(tmp_path: Path) -> None:
    p = tmp_path / "train.log"
    p.write_text(" iteration 99999999999999999999999/ 10 | lm loss: 1.0 |\n")
    clear_error(lambda: read_megatron_log(p), p)


# ---------------------------------------------------------------------------- configs
BAD_CONFIGS = {
    "unknown_key": '[monitor]\nfoo = 1\n',
    "unknown_detector": '[[detectors]]\nname="a"\ndetector="nope"\ninputs=["loss"]\n',
    "unknown_param": '[[detectors]]\nname="a"\ndetector="ewma_z"\ninputs=["loss"]\n'
                     'params={alphaa=0.1}\n',
    "wrong_type": '[[detectors]]\nname="a"\ndetector="ewma_z"\ninputs=["loss"]\n'
                  'params={alpha="big"}\n',
    "huge_window": '[[detectors]]\nname="a"\ndetector="robust_z"\ninputs=["loss"]\n'
                   'params={window=1000000000000000}\n',
    "nan_threshold": '[[detectors]]\nname="a"\ndetector="ewma_z"\ninputs=["loss"]\n'
                     'params={threshold=nan}\n',
    "bad_policy": '[policy]\ncooldown = "x"\n',
    "invalid_toml": '[monitor\n',
    "detectors_table": '[detectors]\nname = "a"\n',
    "duplicate_name": '[[detectors]]\nname="a"\ndetector="ewma_z"\ninputs=["loss"]\n'
                      '[[detectors]]\nname="a"\ndetector="ewma_z"\ninputs=["loss"]\n',
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_bad_config_raises_config_error(tmp_path: Path, name: str) -> None:
    p = tmp_path / f"{name}.toml"
    p.write_text(BAD_CONFIGS[name])
    with pytest.raises(ConfigError):
        load_config(p)


@pytest.mark.parametrize("name", ["unknown_key", "wrong_type", "bad_policy"])
def test_config_errors_name_the_file(tmp_path: Path, name: str) -> None:
    p = tmp_path / f"cfg_{name}.toml"
    p.write_text(BAD_CONFIGS[name])
    clear_error(lambda: load_config(p), p, ConfigError)


@pytest.mark.parametrize("suffix", ["toml", "json"])
def test_deeply_nested_config(tmp_path: Path, suffix: str) -> None:
    depth = 100_000
    p = tmp_path / f"deep.{suffix}"
    if suffix == "toml":
        p.write_text("[monitor]\naliases = { a = " + "[" * depth + "]" * depth + " }\n")
    else:
        p.write_text('{"monitor": {"aliases": ' + "[" * depth + "]" * depth + "}}")
    with pytest.raises(ConfigError):
        load_config(p)


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True), st.text(max_size=8))
_json = st.recursive(_json_leaf, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=3)), max_leaves=12)
_keys = st.sampled_from(["preset", "monitor", "detectors", "policy", "name", "detector", "inputs",
                         "params", "kind", "severity", "critical_factor", "aliases", "strict",
                         "log_only", "threshold", "alpha", "window", "warmup", "cooldown"])


@FUZZ
@given(doc=st.dictionaries(_keys, _json, max_size=4), det=st.dictionaries(_keys, _json,
                                                                           max_size=6))
def test_fuzzed_config_dicts(doc: dict[str, Any], det: dict[str, Any]) -> None:
    if det:
        doc = {**doc, "detectors": [det]}
    try:
        load_config(doc)
    except ConfigError:
        pass


@FUZZ
@given(text=st.text(max_size=200))
def test_fuzzed_config_text(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    p = tmp_path_factory.mktemp("fuzzcfg") / "c.toml"
    p.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(p)
    except ConfigError:
        pass



# ---------------------------------------------------------------------------- round 2 (issue 12)
def test_duplicate_columns_name_the_file(tmp_path: Path) -> None:
    pqf = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array([0, 1]), pa.array([1.0, 2.0]),
                                         pa.array([3.0, 4.0])], names=["step", "loss", "loss"]),
                   pqf)
    e = clear_error(lambda: load_run(pqf), pqf)
    assert "duplicate column 'loss'" in str(e)
    csv = tmp_path / "dup.csv"
    csv.write_text("step,loss,loss\n0,1,2\n1,2,3\n")
    e = clear_error(lambda: load_run(csv), csv)
    assert "duplicate column 'loss'" in str(e)


@pytest.mark.parametrize("case", ["array", "object"])
def test_deeply_nested_jsonl(tmp_path: Path, case: str) -> None:
    p = tmp_path / "deep.jsonl"
    deep = ("[" * 100_000 + "]" * 100_000 if case == "array"
            else '{"a": ' * 500 + "1" + "}" * 500)
    p.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "x": ' + deep + "}\n")
    e = clear_error(lambda: read_jsonl(p), p)
    assert "line 2" in str(e)


def test_non_utf8_csv_and_toml_name_the_file(tmp_path: Path) -> None:
    csv = tmp_path / "latin.csv"
    csv.write_bytes("step,lo\xe9ss\n0,1\n".encode("latin-1"))
    clear_error(lambda: read_csv(csv), csv)
    csv2 = tmp_path / "latin_body.csv"
    csv2.write_bytes("step,loss,note\n0,1,caf\xe9\n".encode("latin-1"))
    clear_error(lambda: read_csv(csv2), csv2)
    toml = tmp_path / "latin.toml"
    toml.write_bytes("# caf\xe9\n[monitor]\n".encode("latin-1"))
    clear_error(lambda: load_config(toml), toml, ConfigError)


def test_huge_integers_name_the_file(tmp_path: Path) -> None:
    digits = "1" + "0" * 5000  # beyond Python's 4300-digit int parsing limit
    p = tmp_path / "huge.jsonl"
    p.write_text('{"step": 0, "loss": ' + digits + "}\n")
    clear_error(lambda: read_jsonl(p), p)
    p2 = tmp_path / "big.jsonl"  # beyond the float range
    p2.write_text('{"step": 0, "loss": 1' + "0" * 400 + "}\n")
    e = clear_error(lambda: read_jsonl(p2), p2)
    assert "line 1" in str(e) and "'loss'" in str(e)
    cfg = tmp_path / "huge.json"
    cfg.write_text('{"monitor": {"x": ' + digits + "}}")
    clear_error(lambda: load_config(cfg), cfg, ConfigError)


def test_int64_metric_above_2_53_is_read_as_float(tmp_path: Path) -> None:
    p = tmp_path / "ints.parquet"
    big = 2**53 + 1
    pq.write_table(pa.table({"step": [0, 1], "tokens": pa.array([big, 5], pa.int64())}), p)
    t = read_run(p)
    assert t.column("tokens").to_pylist() == [float(big), 5.0]


BAD_STEPS = {
    "float_1e300": pa.array([0.0, 1e300]),
    "float_above_2_53": pa.array([0.0, 2.0**60]),
    "float_inf": pa.array([0.0, np.inf]),
    "uint64_wrap": pa.array([0, 2**64 - 1], pa.uint64()),
    "uint64_just_above": pa.array([0, 2**63], pa.uint64()),
    "string_above_int64": pa.array(["0", str(2**63)]),
    "string_1e300": pa.array(["0", "1e300"]),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_out_of_range_steps_are_errors_not_garbage(tmp_path: Path, case: str) -> None:
    """Policy: a step that is not an integer in int64 (floats: |x| <= 2**53) is an error naming
    the file, the column and the row -- never wrapped to a negative step, never skipped."""
    p = tmp_path / f"{case}.parquet"
    pq.write_table(pa.table({"step": BAD_STEPS[case], "loss": [1.0, 2.0]}), p)
    e = clear_error(lambda: read_run(p), p)
    assert "column 'step'" in str(e) and "row 1" in str(e)


def test_out_of_range_steps_in_text_formats(tmp_path: Path) -> None:
    csv = tmp_path / "f.csv"
    csv.write_text("step,loss\n0,1.0\n1e300,1.0\n")
    clear_error(lambda: read_csv(csv), csv)
    jl = tmp_path / "f.jsonl"
    jl.write_text(f'{{"step": 0, "loss": 1}}\n{{"step": {2**64 - 1}, "loss": 1}}\n')
    clear_error(lambda: read_jsonl(jl), jl)


def test_largest_valid_steps_are_kept_exactly(tmp_path: Path) -> None:
    top = 2**63 - 1
    p = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"step": pa.array([2**63 - 5, top], pa.uint64()),
                             "loss": [1.0, 2.0]}), p)
    assert read_run(p).column("step").to_pylist() == [2**63 - 5, top]
    jl = tmp_path / "ok.jsonl"
    jl.write_text(f'{{"step": {top - 1}, "loss": 1}}\n{{"step": {top}, "loss": 2}}\n')
    assert read_jsonl(jl).column("step").to_pylist() == [top - 1, top]


@pytest.mark.parametrize(("detector", "param"), [("histogram_drift", "window"),
                                                 ("histogram_drift", "n_bins"),
                                                 ("robust_z", "window")])
def test_huge_detector_sizes_are_rejected_before_allocating(tmp_path: Path, detector: str,
                                                            param: str) -> None:
    p = tmp_path / "big_window.toml"
    p.write_text(f'[[detectors]]\nname="h"\ndetector="{detector}"\ninputs=["loss"]\n'
                 f"params={{{param}=1000000000}}\n")
    e = clear_error(lambda: load_config(p), p, ConfigError)
    assert param in str(e) and "1,000,000" in str(e)


# ---------------------------------------------------------------------------- event log
@pytest.mark.parametrize("torn", [10, 65_535, 65_536, 200_000, 1_000_000])
def test_torn_event_tail_of_any_length_is_cut(tmp_path: Path, torn: int) -> None:
    p = tmp_path / "events.jsonl"
    with EventLog(p) as log:
        log.info(1, "first")
        log.info(2, "second")
    with p.open("ab") as f:
        f.write(b'{"type":"info","step":3,"message":"' + b"x" * torn)  # killed mid-write
    with EventLog(p) as log:
        log.info(4, "after restart")
    assert [e["step"] for e in read_events(p)] == [1, 2, 4]


def test_event_log_that_is_all_one_torn_record(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"type":"info","step":1,"m":"' + b"y" * 150_000)
    with EventLog(p) as log:
        log.info(2, "fresh")
    assert [e["step"] for e in read_events(p)] == [2]


def test_closed_event_log_never_raises_into_observe(tmp_path: Path) -> None:
    from stability.monitor.monitor import Monitor

    log = EventLog(tmp_path / "events.jsonl")
    mon = Monitor(event_log=log)
    rng = np.random.default_rng(0)
    for s in range(60):
        mon.observe(s, {"loss": 2.0 + 0.01 * rng.standard_normal()})
    log.close()
    for s in range(60, 120):  # a spike: alarms that would be logged
        mon.observe(s, {"loss": 1e6 if s > 100 else 2.0 + 0.01 * rng.standard_normal()})
    assert log.append({"type": "info"}) is False
