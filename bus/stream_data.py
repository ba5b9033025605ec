"""The wire bytes of ``StreamRequest{data: StreamData{data: ...}}``, framed by hand.

Why: a StreamData payload is nearly all of the event bus's bytes. Through protobuf, the
listener copied it into the message field and again to serialize it, and the router
copied it twice more (parse, field read). Framed here, the listener joins the two-varint
header with the payload (or a view of part of it) in one ``bytes.join``, and the router
slices the payload out of the canonical encoding. Everything else (StreamOpen,
StreamClose, and any other encoding of a data message a different client may send) goes
through protobuf, so the wire format is exactly the one ``proto/`` declares.
"""

from __future__ import annotations

from ._gen.continuum.bus.v1 import bus_pb2 as pb
from .errors import BUFFER_OVERFLOW

__all__ = [
    "CLOSE_REASON_WORDS",
    "decode_stream_request",
    "encode_stream_data",
    "encode_stream_request",
]

CLOSE_REASON_WORDS: dict[int, str] = {
    pb.CLOSE_REASON_UNSPECIFIED: "error",
    pb.CLOSE_REASON_BUFFER_OVERFLOW: BUFFER_OVERFLOW,
    pb.CLOSE_REASON_DRAINING: "draining",
    pb.CLOSE_REASON_UNSUBSCRIBED: "unsubscribed",
    pb.CLOSE_REASON_ERROR: "error",
}
"""``StreamClose.reason`` as the word logs and counters use (the SSE error record's)."""

# StreamRequest.data is field 2, StreamData.data field 1; both length-delimited (wire
# type 2), so their tags are (2 << 3) | 2 and (1 << 3) | 2.
_DATA_TAG = b"\x12"
_BYTES_TAG = b"\x0a"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when ``buf`` ends inside it or it runs past
    ten bytes (no canonical length does)."""
    value = shift = 0
    end = min(len(buf), pos + 10)
    while pos < end:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def encode_stream_data(payload: bytes | memoryview) -> bytes:
    """The serialized ``StreamRequest`` whose StreamData holds ``payload``: byte for byte
    what ``StreamRequest(data=StreamData(data=payload)).SerializeToString()`` gives."""
    size = len(payload)
    if size == 0:
        return _DATA_TAG + b"\x00"  # proto3 leaves an empty bytes field out
    inner = _varint(size)
    outer = _varint(1 + len(inner) + size)
    return b"".join((_DATA_TAG, outer, _BYTES_TAG, inner, payload))


def encode_stream_request(msg: pb.StreamRequest | bytes) -> bytes:
    """Request serializer of the Stream call: bytes from :func:`encode_stream_data` pass
    through as they are, messages are serialized."""
    if type(msg) is bytes:
        return msg
    return msg.SerializeToString()  # type: ignore[union-attr]


def decode_stream_request(raw: bytes) -> bytes | pb.StreamRequest:
    """Request deserializer of the Stream call: the payload itself when ``raw`` is the
    canonical encoding of a non-empty data message (what :func:`encode_stream_data`
    makes), else the parsed ``StreamRequest`` (which raises ``DecodeError`` on bytes
    that are not one, as the generated deserializer does)."""
    if raw[:1] == _DATA_TAG:
        outer, pos = _read_varint(raw, 1)
        if outer == len(raw) - pos and raw[pos : pos + 1] == _BYTES_TAG:
            inner, start = _read_varint(raw, pos + 1)
            if inner == len(raw) - start and inner > 0:
                return raw[start:]
    return pb.StreamRequest.FromString(raw)
