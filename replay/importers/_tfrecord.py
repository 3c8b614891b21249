"""The wire formats under TensorBoard event files: TFRecord framing and protobuf fields.

A TFRecord is ``uint64 length | uint32 masked-CRC32C(length) | data | uint32
masked-CRC32C(data)`` (:func:`iter_records` reads them, :func:`_frame` writes one); the payload
is a protobuf message, read field by field (:func:`_fields`, varints) and written with
:func:`_key` / :func:`_enc_varint` / :func:`_len_field`. Pure Python, no TensorFlow; the
TensorBoard ``Event`` schema on top is :mod:`replay.importers.tensorboard`, which re-exports
the public names.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterator

from replay.schema import RunFormatError

__all__ = ["crc32c", "iter_records", "masked_crc32c"]

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




# --------------------------------------------------------------------------- encoding


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
