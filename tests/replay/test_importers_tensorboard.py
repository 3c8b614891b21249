"""TensorBoard importer: real SummaryWriter / HF files, own TFRecord encoder, hostile files."""

from __future__ import annotations

import math
import shutil
import struct

import numpy as np
import pytest

from replay.importers.tensorboard import (
    _enc_varint,
    _frame,
    _key,
    _len_field,
    crc32c,
    iter_records,
    masked_crc32c,
    read_tensorboard,
    write_scalar_events,
)
from replay.schema import RunFormatError

from .fixtures import FIXTURES


def test_crc32c_known_vectors():
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4
    assert crc32c(bytes([0xFF] * 32)) == 0x62A8AB43


def test_torch_summary_writer_fixture():
    t = read_tensorboard(FIXTURES / "tb_torch")
    d = t.to_pydict()
    assert d["step"] == list(range(20))
    assert set(t.column_names) == {"step", "train/loss", "lr", "val/loss", "grad_norm", "spike"}
    loss = np.array(d["train/loss"], dtype=float)
    assert math.isnan(loss[7])
    np.testing.assert_allclose(
        np.delete(loss, 7), np.delete(3.0 - 0.1 * np.arange(20), 7), rtol=1e-6
    )  # simple_value is float32
    assert d["grad_norm"] == [1.0 + s for s in range(20)]  # double tensor: exact
    assert d["val/loss"][0] == pytest.approx(3.5) and d["val/loss"][1] is None  # float tensor
    assert d["spike"][19] == math.inf
    assert d["lr"][19] == pytest.approx(1e-3)


def test_hf_trainer_tensorboard_fixture():
    t = read_tensorboard(FIXTURES / "hf_run" / "events.out.tfevents.hf")
    assert t.column("step").to_pylist() == list(range(1, 13))
    for tag in ("train/loss", "train/grad_norm", "train/learning_rate", "eval/loss"):
        assert tag in t.column_names
    assert t.column("eval/loss").null_count == 9  # eval every 4 steps


def test_own_writer_round_trip_and_tags(tmp_path):
    p = tmp_path / "events.out.tfevents.1"
    write_scalar_events(p, [(0, {"a": 1.0}), (5, {"a": 2.0, "b": -3.0}), (5, {"a": 4.0})])
    t = read_tensorboard(p)
    assert t.to_pydict() == {"step": [0, 5], "a": [1.0, 4.0], "b": [None, -3.0]}
    assert read_tensorboard(p, tags=["b"]).column_names == ["step", "b"]
    with pytest.raises(RunFormatError, match="no scalar summaries"):
        read_tensorboard(p, tags=["zzz"])


def test_tensorboard_protobuf_agrees_with_own_writer(tmp_path):
    event_pb2 = pytest.importorskip("tensorboard.compat.proto.event_pb2")
    p = tmp_path / "events.out.tfevents.2"
    write_scalar_events(p, [(-3, {"x/y": 0.5})])
    records = list(iter_records(p.read_bytes()))
    e = event_pb2.Event()
    e.ParseFromString(bytes(records[1]))
    assert e.step == -3 and e.summary.value[0].tag == "x/y"
    assert e.summary.value[0].simple_value == 0.5


def _tensor_value(tag: str, tensor: bytes, plugin: str | None = None) -> bytes:
    body = _len_field(1, tag.encode()) + _len_field(8, tensor)
    if plugin is not None:
        body += _len_field(9, _len_field(1, _len_field(1, plugin.encode())))
    return _len_field(1, body)


def _event(step: int, values: bytes) -> bytes:
    return _frame(_key(2, 0) + _enc_varint(step) + _len_field(5, values))


def test_tensor_dtypes(tmp_path):
    scalar_shape = _len_field(2, b"")
    cases = {
        "f32_packed": _key(1, 0)
        + _enc_varint(1)
        + scalar_shape
        + _len_field(5, struct.pack("<f", 1.5)),
        "f64_content": _key(1, 0)
        + _enc_varint(2)
        + scalar_shape
        + _len_field(4, struct.pack("<d", 0.1)),
        "i32": _key(1, 0) + _enc_varint(3) + scalar_shape + _len_field(7, _enc_varint(-7)),
        "i64": _key(1, 0) + _enc_varint(9) + scalar_shape + _len_field(10, _enc_varint(2**40)),
        "half": _key(1, 0)
        + _enc_varint(19)
        + scalar_shape
        + _len_field(13, _enc_varint(int(np.array([0.25], np.float16).view(np.uint16)[0]))),
        "bf16": _key(1, 0)
        + _enc_varint(14)
        + scalar_shape
        + _len_field(13, _enc_varint(int(np.array([3.0], np.float32).view(np.uint32)[0] >> 16))),
        "bool": _key(1, 0) + _enc_varint(10) + scalar_shape + _len_field(11, _enc_varint(1)),
        "f32_unpacked": _key(1, 0)
        + _enc_varint(1)
        + scalar_shape
        + _key(5, 5)
        + struct.pack("<f", 2.0),
        "f32_one_dim": _key(1, 0)
        + _enc_varint(1)
        + _len_field(2, _len_field(2, _key(1, 0) + _enc_varint(1)))
        + _len_field(5, struct.pack("<f", 6.0)),
    }
    ignored = {
        "vector": _key(1, 0)
        + _enc_varint(1)
        + _len_field(2, _len_field(2, _key(1, 0) + _enc_varint(2)))
        + _len_field(5, struct.pack("<ff", 1, 2)),
        "string": _key(1, 0) + _enc_varint(7) + scalar_shape + _len_field(8, b"hello"),
    }
    values = b"".join(_tensor_value(k, v) for k, v in {**cases, **ignored}.items())
    values += _tensor_value("text_plugin", cases["f32_packed"], plugin="text")
    data = _frame(_key(3, 2) + b"\x0dbrain.Event:2") + _event(4, values)
    # the second event carries no metadata: the tag keeps its plugin ("text") from the first
    data += _event(5, _tensor_value("text_plugin", cases["f32_packed"]))
    p = tmp_path / "events.out.tfevents.3"
    p.write_bytes(data)
    row = read_tensorboard(p).to_pylist()[0]
    assert row == {
        "step": 4,
        "f32_packed": 1.5,
        "f64_content": 0.1,
        "i32": -7.0,
        "i64": 2.0**40,
        "half": 0.25,
        "bf16": 3.0,
        "bool": 1.0,
        "f32_unpacked": 2.0,
        "f32_one_dim": 6.0,
    }


def test_directory_with_subfolders_prefixes_tags(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    write_scalar_events(tmp_path / "train" / "events.out.tfevents.1", [(0, {"loss": 1.0})])
    write_scalar_events(tmp_path / "eval" / "events.out.tfevents.1", [(0, {"loss": 2.0})])
    t = read_tensorboard(tmp_path)
    assert sorted(t.column_names) == ["eval/loss", "step", "train/loss"]
    t = read_tensorboard(f"file://{tmp_path}/train")
    assert t.column_names == ["step", "loss"]


def test_truncated_tail_warns_and_keeps_the_rest(tmp_path):
    src = FIXTURES / "tb_torch" / "events.out.tfevents.torch"
    p = tmp_path / "events.out.tfevents.trunc"
    data = src.read_bytes()
    p.write_bytes(data[:-7])
    with pytest.warns(UserWarning, match="events.out.tfevents.trunc: truncated TFRecord at byte"):
        t = read_tensorboard(p)
    assert t.num_rows == 20


def test_corruption_is_an_error_naming_the_file(tmp_path):
    src = FIXTURES / "tb_torch" / "events.out.tfevents.torch"
    data = bytearray(src.read_bytes())
    p = tmp_path / "events.out.tfevents.bad"
    data[200] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(RunFormatError, match=r"events.out.tfevents.bad: .*(CRC|corrupted)"):
        read_tensorboard(p)
    # header CRC
    p.write_bytes(b"\x05" + bytes(15))
    with pytest.raises(RunFormatError, match="corrupted TFRecord length header at byte 0"):
        read_tensorboard(p)
    # valid framing, invalid protobuf inside
    p.write_bytes(_frame(b"\x2a\xff\xff\xff\xff\x0f"))
    with pytest.raises(RunFormatError, match="undecodable Event record #0"):
        read_tensorboard(p)
    # garbage and empty directory
    p.write_bytes(b"not a tfrecord at all, just text......")
    with pytest.raises(RunFormatError, match="events.out.tfevents.bad"):
        read_tensorboard(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunFormatError, match="no TensorBoard event files"):
        read_tensorboard(tmp_path / "empty")
    with pytest.raises(RunFormatError, match="no such file"):
        read_tensorboard(tmp_path / "missing")


def test_verify_crc_off_reads_payload_corruption(tmp_path):
    p = tmp_path / "events.out.tfevents.x"
    write_scalar_events(p, [(1, {"a": 1.0})])
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # last data CRC byte
    p.write_bytes(bytes(data))
    with pytest.raises(RunFormatError, match="CRC mismatch"):
        read_tensorboard(p)
    assert read_tensorboard(p, verify_crc=False).num_rows == 1
    assert masked_crc32c(b"x") != crc32c(b"x")
    shutil.rmtree(tmp_path)
