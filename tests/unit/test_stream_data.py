"""``bus.stream_data``: hand-framed StreamData must be the protobuf wire format exactly.

The listener sends these bytes to any router, and the router reads any client's bytes with
this decoder, so both directions are checked against the generated protobuf code: the
encoder byte for byte, the decoder on every input, canonical or not, valid or not.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.stream_data import decode_stream_request, encode_stream_data, encode_stream_request

payloads = st.binary(max_size=3000)


def reference(payload: bytes) -> bytes:
    return pb.StreamRequest(data=pb.StreamData(data=payload)).SerializeToString()


@given(payloads)
def test_encoding_is_what_protobuf_serializes(payload: bytes) -> None:
    assert encode_stream_data(payload) == reference(payload)
    assert encode_stream_data(memoryview(payload)) == reference(payload)  # the writer's cuts


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 262_144, 2_097_152])
def test_encoding_at_varint_boundaries(size: int) -> None:
    payload = b"x" * size
    wire = encode_stream_data(payload)
    assert wire == reference(payload)
    decoded = decode_stream_request(wire)
    if size:
        assert decoded == payload  # the fast path: the payload itself
    else:
        assert isinstance(decoded, pb.StreamRequest) and decoded.WhichOneof("kind") == "data"


@given(payloads)
def test_the_decoder_hands_over_the_payload(payload: bytes) -> None:
    decoded = decode_stream_request(encode_stream_data(payload))
    if payload:
        assert type(decoded) is bytes and decoded == payload
    else:
        assert decoded == pb.StreamRequest(data=pb.StreamData())


def test_other_messages_go_through_protobuf() -> None:
    for msg in (
        pb.StreamRequest(open=pb.StreamOpen(stream_id="s-1")),
        pb.StreamRequest(close=pb.StreamClose(reason=pb.CLOSE_REASON_DRAINING, detail="d")),
        pb.StreamRequest(),
    ):
        wire = encode_stream_request(msg)
        assert wire == msg.SerializeToString()
        assert decode_stream_request(wire) == msg


def test_non_canonical_data_encodings_read_as_protobuf_reads_them() -> None:
    data = reference(b"abc")
    cases = [
        data + reference(b"def"),  # the field twice: protobuf merges, the last bytes win
        data + b"\x1a\x00",  # a StreamClose after it: the oneof's last member wins
        b"\x12\x07\x0a\x03abc\x10\x01",  # an unknown field inside StreamData
        b"\x12\x06\x0a\x83\x00abc",  # a non-minimal varint (3 in two bytes)
    ]
    for wire in cases:
        expected = pb.StreamRequest.FromString(wire)
        got = decode_stream_request(wire)
        if type(got) is bytes:
            assert expected.WhichOneof("kind") == "data" and got == expected.data.data
        else:
            assert got == expected


@pytest.mark.parametrize(
    "wire",
    [
        b"\x12",  # tag, no length
        b"\x12\x05\x0a\x03ab",  # StreamData shorter than its length says
        b"\x12\x05\x0a\x09abc",  # payload shorter than its length says
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
        b"\x12\x04\x0a\x03abc",  # outer length one short
    ],
)
def test_malformed_bytes_raise_like_protobuf(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.StreamRequest.FromString(wire)
    with pytest.raises(DecodeError):
        decode_stream_request(wire)


def decodes_like_protobuf(wire: bytes) -> None:
    try:
        expected = pb.StreamRequest.FromString(wire)
    except DecodeError:
        with pytest.raises(DecodeError):
            decode_stream_request(wire)
        return
    got = decode_stream_request(wire)
    if type(got) is bytes:
        assert expected.WhichOneof("kind") == "data" and got == expected.data.data
    else:
        assert got == expected


@given(st.binary(max_size=64))
def test_any_bytes_decode_as_protobuf_decodes_them(wire: bytes) -> None:
    decodes_like_protobuf(wire)


@given(st.binary(min_size=1, max_size=40), st.binary(max_size=8), st.integers(0, 48))
def test_data_messages_cut_or_extended_decode_as_protobuf_decodes_them(
    payload: bytes, tail: bytes, cut: int
) -> None:
    wire = reference(payload)
    decodes_like_protobuf(wire + tail)
    decodes_like_protobuf(wire[:cut])
