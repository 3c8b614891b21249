"""TensorBoard event files -> recorded-run table, with a small pure-Python reader (no TensorFlow).

An event file is a sequence of TFRecords (``uint64 length | uint32 masked-CRC32C(length) | data |
uint32 masked-CRC32C(data)``); each record is a serialized ``tensorflow.Event`` protobuf. Only the
fields needed for scalars are decoded:

* ``Event.step`` (2), ``Event.summary`` (5) -> ``Summary.value`` (1) -> ``Value.tag`` (1),
  ``Value.simple_value`` (2, float32: what ``torch.utils.tensorboard`` and TF1 write),
  ``Value.metadata`` (9, for the plugin name) and ``Value.tensor`` (8, what TF2 / ``new_style``
  write): a one-element numeric ``TensorProto`` (``float_val``, ``double_val``, ``int_val``,
  ``int64_val``, ``half_val``, ``bool_val`` or raw ``tensor_content``).

Histograms, images, text and other non-scalar summaries are ignored. A truncated last record
(the writer was killed) ends the file with a warning; a CRC mismatch or an undecodable record
elsewhere is a :class:`replay.schema.RunFormatError` naming the file and the byte offset.

A directory is searched recursively for ``*tfevents*`` files, read in name order (i.e. time
order); when they sit in several sub-directories (``add_scalars``, one run per folder) tags are
prefixed with the relative folder (``"eval/loss"`` in folder ``"b"`` becomes ``"b/eval/loss"``).
Several values for the same step and tag: the last one read wins.

Examples
--------
>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "events.out.tfevents.1.host")
>>> write_scalar_events(path, [(0, {"loss": 2.5}), (1, {"loss": float("nan"), "lr": 0.1})])
>>> read_tensorboard(path).to_pydict()
{'step': [0, 1], 'loss': [2.5, nan], 'lr': [None, 0.10000000149011612]}
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.importers._files import read_bytes
from replay.schema import RunFormatError, make_metadata, table_from_records

__all__ = [
    "crc32c",
    "iter_records",
    "iter_scalars",
    "masked_crc32c",
    "read_tensorboard",
    "write_scalar_events",
]

# --------------------------------------------------------------------------- CRC32C (Castagnoli)


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _make_table()


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``.

    Examples
    --------
    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    """
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | memoryview) -> int:
    """The masked CRC TFRecord stores: ``rotr15(crc) + 0xa282ead8``.

    Examples
    --------
    >>> masked_crc32c(b"") == (0xA282EAD8)
    True
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --------------------------------------------------------------------------- TFRecord framing


def iter_records(
    data: bytes, source: object = "<bytes>", verify_crc: bool = True
) -> Iterator[memoryview]:
    """Yield the payload of every TFRecord in ``data``.

    A truncated final record is dropped with a warning; a CRC mismatch raises.

    Examples
    --------
    >>> rec = b"abc"
    >>> framed = (struct.pack("<Q", 3) + struct.pack("<I", masked_crc32c(struct.pack("<Q", 3)))
    ...           + rec + struct.pack("<I", masked_crc32c(rec)))
    >>> [bytes(r) for r in iter_records(framed + framed)]
    [b'abc', b'abc']
    """
    view = memoryview(data)
    pos, n = 0, len(data)
    while pos < n:
        if pos + 12 > n:
            _warn_truncated(source, pos)
            return
        header = view[pos : pos + 8]
        (length,) = struct.unpack_from("<Q", view, pos)
        (len_crc,) = struct.unpack_from("<I", view, pos + 8)
        if masked_crc32c(header) != len_crc:
            raise RunFormatError(source, f"corrupted TFRecord length header at byte {pos}")
        end = pos + 12 + length
        if end + 4 > n:
            _warn_truncated(source, pos)
            return
        payload = view[pos + 12 : end]
        if verify_crc:
            (data_crc,) = struct.unpack_from("<I", view, end)
            if masked_crc32c(payload) != data_crc:
                raise RunFormatError(source, f"TFRecord data CRC mismatch at byte {pos}")
        yield payload
        pos = end + 4


def _warn_truncated(source: object, pos: int) -> None:
    warnings.warn(
        f"{source}: truncated TFRecord at byte {pos} (writer interrupted?); "
        "ignoring the incomplete last record",
        UserWarning,
        stacklevel=3,
    )


# --------------------------------------------------------------------------- protobuf decoding


class _ProtoError(Exception):
    pass


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise _ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise _ProtoError("varint too long")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """Yield ``(field_number, wire_type, value)``; length-delimited values as memoryviews."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 1:
            if pos + 8 > n:
                raise _ProtoError("truncated fixed64")
            yield field, wire, int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > n:
                raise _ProtoError("truncated length-delimited field")
            yield field, wire, buf[pos : pos + length]
            pos += length
        elif wire == 5:
            if pos + 4 > n:
                raise _ProtoError("truncated fixed32")
            yield field, wire, int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise _ProtoError(f"unsupported wire type {wire}")


# TensorFlow DataType enum -> (numpy dtype for tensor_content, repeated field holding values)
_DTYPES: dict[int, tuple[str, int]] = {
    1: ("<f4", 5),  # DT_FLOAT  float_val
    2: ("<f8", 6),  # DT_DOUBLE double_val
    3: ("<i4", 7),  # DT_INT32  int_val
    4: ("<u1", 7),  # DT_UINT8
    5: ("<i2", 7),  # DT_INT16
    6: ("<i1", 7),  # DT_INT8
    9: ("<i8", 10),  # DT_INT64  int64_val
    10: ("?", 11),  # DT_BOOL   bool_val
    14: ("bf16", 13),  # DT_BFLOAT16 half_val
    17: ("<u2", 7),  # DT_UINT16
    19: ("<f2", 13),  # DT_HALF   half_val
    22: ("<u4", 16),  # DT_UINT32 uint32_val
    23: ("<u8", 17),  # DT_UINT64 uint64_val
}


def _f32(bits: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def _f64(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def _signed(v: int, bits: int) -> int:
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _tensor_scalar(buf: memoryview) -> float | None:
    """The value of a one-element numeric TensorProto, else None."""
    dtype = 0
    n_elems = 1
    content: memoryview | None = None
    values: dict[int, list[int | memoryview]] = {}
    wires: dict[int, int] = {}
    for f, w, v in _fields(buf):
        if f == 1 and isinstance(v, int):
            dtype = v
        elif f == 2 and isinstance(v, memoryview):
            for g, _, dim in _fields(v):
                if g == 2 and isinstance(dim, memoryview):
                    size = next((s for h, _, s in _fields(dim) if h == 1), 0)
                    n_elems *= int(size) if isinstance(size, int) else 0
        elif f == 4 and isinstance(v, memoryview):
            content = v
        else:
            values.setdefault(f, []).append(v)
            wires[f] = w
    spec = _DTYPES.get(dtype)
    if spec is None or n_elems != 1:
        return None
    np_dtype, field = spec
    if content is not None and len(content):
        if np_dtype == "bf16":
            raw = np.frombuffer(bytes(content), dtype="<u2").astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(bytes(content), dtype=np_dtype)
        return float(arr[0]) if arr.size == 1 else None
    items = values.get(field)
    if not items:
        return None
    first = items[0]
    if isinstance(first, memoryview):  # packed
        if field == 5:
            return float(np.frombuffer(bytes(first[:4]), "<f4")[0]) if len(first) >= 4 else None
        if field == 6:
            return float(np.frombuffer(bytes(first[:8]), "<f8")[0]) if len(first) >= 8 else None
        ints: list[int] = []
        pos = 0
        while pos < len(first) and not ints:
            x, pos = _varint(first, pos)
            ints.append(x)
        if not ints:
            return None
        raw_int = ints[0]
    else:
        raw_int = first
        if field == 5:
            return _f32(raw_int)
        if field == 6:
            return _f64(raw_int)
    if field == 13:  # half_val holds the bit pattern
        if np_dtype == "bf16":
            return _f32((raw_int & 0xFFFF) << 16)
        return float(np.array([raw_int & 0xFFFF], dtype=np.uint16).view(np.float16)[0])
    if field in (7, 10):  # negative int32 values are sign-extended to 64 bits on the wire
        return float(raw_int if np_dtype[1] == "u" else _signed(raw_int, 64))
    return float(raw_int)


def _plugin_name(buf: memoryview) -> str | None:
    for f, _, v in _fields(buf):
        if f == 1 and isinstance(v, memoryview):
            for g, _, name in _fields(v):
                if g == 1 and isinstance(name, memoryview):
                    return bytes(name).decode("utf-8", "replace")
    return None


def iter_scalars(
    data: bytes, source: object = "<bytes>", verify_crc: bool = True
) -> Iterator[tuple[int, str, float]]:
    """Yield ``(step, tag, value)`` for every scalar in one event file's bytes.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "events.out.tfevents.0")
    >>> write_scalar_events(p, [(3, {"a": 1.0})])
    >>> list(iter_scalars(open(p, "rb").read()))
    [(3, 'a', 1.0)]
    """
    plugins: dict[str, str] = {}  # tag -> plugin name (only written on a tag's first event)
    offset = 0
    for record in iter_records(data, source, verify_crc):
        try:
            step = 0
            summary: memoryview | None = None
            for f, _, v in _fields(record):
                if f == 2 and isinstance(v, int):
                    step = _signed(v, 64)
                elif f == 5 and isinstance(v, memoryview):
                    summary = v
            if summary is None:
                continue
            for f, _, value in _fields(summary):
                if f != 1 or not isinstance(value, memoryview):
                    continue
                tag = None
                simple: float | None = None
                tensor: memoryview | None = None
                plugin: str | None = None
                for g, _, x in _fields(value):
                    if g == 1 and isinstance(x, memoryview):
                        tag = bytes(x).decode("utf-8", "replace")
                    elif g == 2 and isinstance(x, int):
                        simple = _f32(x)
                    elif g == 8 and isinstance(x, memoryview):
                        tensor = x
                    elif g == 9 and isinstance(x, memoryview):
                        plugin = _plugin_name(x)
                if tag is None:
                    continue
                if plugin is not None:
                    plugins[tag] = plugin
                if simple is not None:
                    yield step, tag, simple
                elif tensor is not None and plugins.get(tag, "scalars") == "scalars":
                    scalar = _tensor_scalar(tensor)
                    if scalar is not None:
                        yield step, tag, scalar
        except _ProtoError as exc:
            raise RunFormatError(source, f"undecodable Event record #{offset}: {exc}") from None
        offset += 1


# --------------------------------------------------------------------------- files and dirs


def _event_files(path: str) -> tuple[list[tuple[str, str]], str]:
    """[(file to read, tag prefix)] for a file, directory or URI."""
    if is_uri(path):
        fs, inner = pafs.FileSystem.from_uri(path)
        scheme = path[: path.index("://") + 3]
        show = scheme + inner if not scheme.startswith("file") else "file://" + inner
    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(path)
        show = path
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        raise RunFormatError(path, "no such file or directory")
    if info.type == pafs.FileType.File:
        return [(path, "")], show
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    found = sorted(
        i.path for i in infos if i.type == pafs.FileType.File and "tfevents" in i.base_name
    )
    if not found:
        raise RunFormatError(path, "no TensorBoard event files (*tfevents*) in directory")
    dirs = {f.rpartition("/")[0] for f in found}
    out = []
    for f in found:
        rel = os.path.relpath(f.rpartition("/")[0], inner).replace(os.sep, "/")
        prefix = "" if len(dirs) == 1 or rel == "." else rel + "/"
        full = path.rstrip("/") + "/" + os.path.relpath(f, inner).replace(os.sep, "/")
        out.append((full, prefix))
    return out, show


def read_tensorboard(
    path: str | os.PathLike[str],
    tags: Sequence[str] | None = None,
    verify_crc: bool = True,
) -> pa.Table:
    """Read the scalars of TensorBoard event file(s) as a wide run table.

    Parameters
    ----------
    path : str or PathLike
        An event file, or a directory searched recursively (local or URI).
    tags : sequence of str, optional
        Keep only these tags (after the folder prefix).
    verify_crc : bool
        Check each record's CRC32C (pure Python; about 1 s per 10 MB).

    Returns
    -------
    pa.Table
        One column per tag, float64 (``simple_value`` is float32 in the file).

    Raises
    ------
    RunFormatError
        Missing file, CRC mismatch, undecodable record, or no scalars at all.
    """
    text = os.fspath(path)
    files, _ = _event_files(text)
    wanted = None if tags is None else set(tags)

    def records() -> Iterator[tuple[int, dict[str, float | None]]]:
        for fname, prefix in files:
            for step, tag, value in iter_scalars(read_bytes(fname), fname, verify_crc):
                name = prefix + tag
                if wanted is None or name in wanted:
                    yield step, {name: value}

    table = table_from_records(
        records(), make_metadata(run={"source": text, "format": "tensorboard"})
    )
    if table.num_rows == 0:
        raise RunFormatError(text, "no scalar summaries found in the event file(s)")
    return table


# --------------------------------------------------------------------------- writing


def _key(field: int, wire: int) -> bytes:
    return _enc_varint((field << 3) | wire)


def _enc_varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _enc_varint(len(payload)) + payload


def _frame(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


def write_scalar_events(
    path: str | os.PathLike[str],
    records: Iterable[tuple[int, Mapping[str, float]]],
    wall_time: float = 0.0,
) -> None:
    """Write ``(step, {tag: value})`` records as a TensorBoard event file (``simple_value``).

    Enough for tests and for exporting a run to TensorBoard without TensorFlow.

    Examples
    --------
    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "events.out.tfevents.0")
    >>> write_scalar_events(p, [(0, {"loss": 1.0})])
    >>> os.path.getsize(p) > 0
    True
    """
    chunks = [_frame(_key(1, 1) + struct.pack("<d", wall_time) + _len_field(3, b"brain.Event:2"))]
    for step, metrics in records:
        values = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", val))
            for tag, val in metrics.items()
        )
        event = (
            _key(1, 1)
            + struct.pack("<d", wall_time)
            + _key(2, 0)
            + _enc_varint(int(step))
            + _len_field(5, values)
        )
        chunks.append(_frame(event))
    with open(path, "wb") as fh:
        fh.write(b"".join(chunks))
