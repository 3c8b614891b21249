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
The TFRecord framing and protobuf wire format are in :mod:`replay.importers._tfrecord`.

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
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from replay._paths import is_uri
from replay.importers._files import read_bytes
from replay.importers._tfrecord import (
    _enc_varint,
    _fields,
    _frame,
    _key,
    _len_field,
    _ProtoError,
    _varint,
    crc32c,
    iter_records,
    masked_crc32c,
)
from replay.schema import RunFormatError, make_metadata, table_from_records

__all__ = [
    "crc32c",
    "iter_records",
    "iter_scalars",
    "masked_crc32c",
    "read_tensorboard",
    "write_scalar_events",
]

# --------------------------------------------------------------------------- Event decoding

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
