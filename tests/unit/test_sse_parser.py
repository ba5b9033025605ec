"""``bus.sse.SseParser`` and ``bus.events.KvEvent.from_json``: the router's per-event parsers.

The parser is checked against a reference that reads the whole stream at once, written
straight from the WHATWG EventSource rules, for any split of the bytes into chunks and
any mix of LF, CRLF and CR line ends; the chunk split decides whether the parser takes its
LF-only fast path or its general scanner, so both are covered by the same properties.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.events import EventError, KvEvent
from bus.sse import SseOverflow, SseParser, SseRecord, encode_comment, encode_record

# -- reference ---------------------------------------------------------------------------------


def reference(stream: bytes, last_id: str | None = None) -> list[SseRecord]:
    """Every record of a complete stream (an unfinished last record is not dispatched)."""
    out = []
    data: list[bytes] = []
    event = None
    for line in re.split(rb"\r\n|\r|\n", stream)[:-1]:  # the last piece is unfinished
        if not line:
            if data:
                out.append(SseRecord(b"\n".join(data), event, last_id))
            data, event = [], None
            continue
        if line.startswith(b":"):
            continue
        field, sep, value = line.partition(b":")
        if sep and value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            event = value.decode("utf-8", "replace")
        elif field == b"id" and b"\x00" not in value:
            last_id = value.decode("utf-8", "replace")
    return out


def feed_all(parser: SseParser, chunks: list[bytes]) -> list[SseRecord]:
    out: list[SseRecord] = []
    for c in chunks:
        out += parser.feed(c)
    return out


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks, start = [], 0
    for p in points:
        chunks.append(stream[start:p])
        start = p
    chunks.append(stream[start:])
    return chunks


# -- strategies --------------------------------------------------------------------------------

_text = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_line = st.one_of(
    st.builds(lambda v: b"data: " + v, _text),
    st.builds(lambda v: b"data:" + v, _text),
    st.just(b"data"),
    st.builds(lambda v: b"event: " + v, _text),
    st.builds(lambda v: b"id: " + v, _text),
    st.just(b"id: a\x00b"),
    st.just(b"id"),
    st.builds(lambda v: b": " + v, _text),
    st.builds(lambda v: b"retry: " + v, _text),
    st.builds(lambda v: b"x-unknown:" + v, _text),
    st.just(b""),
)
_eol = st.sampled_from([b"\n", b"\r\n", b"\r"])
streams = st.lists(st.tuples(_line, _eol), max_size=40).map(
    lambda pairs: b"".join(line + eol for line, eol in pairs)
)
lf_streams = st.lists(_line, max_size=40).map(lambda lines: b"".join(x + b"\n" for x in lines))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams, st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_split_any_line_ends_matches_the_reference(stream: bytes, cuts: list[int]) -> None:
    got = feed_all(SseParser(), split(stream, cuts))
    # A stream ending in CR whose LF might still come: the reference treats the CR as a
    # line end, which the parser only knows once more bytes (or none) arrive.
    assert got == reference(stream)


@settings(max_examples=300, deadline=None)
@given(lf_streams, st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_lf_only_streams_take_the_fast_path_and_match(stream: bytes, cuts: list[int]) -> None:
    parser = SseParser(last_id="start")
    assert feed_all(parser, split(stream, cuts)) == reference(stream, "start")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
            st.none() | st.sampled_from(["cache_created", "resync", "é"]),
            st.none() | st.text(alphabet="abc-0123456789", max_size=10),
        ),
        max_size=20,
    ),
    st.integers(min_value=1, max_value=64),
)
def test_encoded_records_round_trip_in_chunks_of_any_size(
    recs: list[tuple[bytes, str | None, str | None]], size: int
) -> None:
    stream = b"".join(encode_record(d, event=e, id=i) + encode_comment("hb") for d, e, i in recs)
    chunks = [stream[k : k + size] for k in range(0, len(stream), size)]
    got = feed_all(SseParser(), chunks)
    last: str | None = None
    want = []
    for d, e, i in recs:
        last = i if i is not None else last
        want.append(SseRecord(d, e, last))
    assert got == want


def test_cr_split_from_its_lf_across_chunks_is_one_line_end() -> None:
    p = SseParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\n\r") == [SseRecord(b"a")]
    assert p.feed(b"\ndata: b\n\n") == [SseRecord(b"b")]


def test_multiline_data_and_id_persistence() -> None:
    p = SseParser()
    recs = p.feed(b"id: 7\ndata: a\ndata: b\n\ndata: c\n\nid\ndata: d\n\n")
    # A bare ``id`` line is an empty id: it resets the last event ID ("" = send none).
    assert recs == [
        SseRecord(b"a\nb", None, "7"),
        SseRecord(b"c", None, "7"),
        SseRecord(b"d", None, ""),
    ]


@pytest.mark.parametrize("cr", [False, True], ids=["lf", "crlf"])
def test_line_over_the_cap_overflows_and_leaves_no_buffer(cr: bool) -> None:
    p = SseParser(max_size=64)
    eol = b"\r\n" if cr else b"\n"
    assert p.feed(b"data: ok" + eol + eol) == [SseRecord(b"ok")]
    with pytest.raises(SseOverflow, match="line longer"):
        p.feed(b"data: " + b"x" * 70)
    assert len(p._buf) == 0


@pytest.mark.parametrize("cr", [False, True], ids=["lf", "crlf"])
def test_record_over_the_cap_overflows(cr: bool) -> None:
    p = SseParser(max_size=64)
    eol = b"\r\n" if cr else b"\n"
    with pytest.raises(SseOverflow, match="record data larger"):
        p.feed(b"".join(b"data: " + b"y" * 20 + eol for _ in range(4)))


def test_cap_holds_over_many_small_chunks() -> None:
    p = SseParser(max_size=1000)
    with pytest.raises(SseOverflow):
        for _ in range(200):
            p.feed(b"zzzzzzzzzz")


# -- KvEvent.from_json ---------------------------------------------------------------------------

HEX = "ab" * 32
VALID: dict[str, Any] = {
    "event": "cache_created",
    "backend": "vllm-1",
    "prefix_hash": HEX,
    "token_count": 512,
    "tier": "gpu",
}
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([*sorted(VALID), "reason"]), json_values)
def test_any_json_in_any_field_is_an_event_or_an_event_error(field: str, value: Any) -> None:
    obj = {**VALID, field: value}
    try:
        ev = KvEvent.from_json(orjson.dumps(obj))
    except EventError:
        return
    assert ev.event in ("cache_created", "cache_evicted", "cache_offloaded")
    # A valid value may replace a valid one (backend "0" is a name like any other).
    assert ev.prefix_hash == (value if field == "prefix_hash" else HEX)
    assert ev.backend == (value if field == "backend" else "vllm-1")


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_document_is_an_event_or_an_event_error(value: Any) -> None:
    with pytest.raises(EventError):
        KvEvent.from_json(orjson.dumps(value))


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"event": ["cache_created"]}, "unknown event kind"),
        ({"tier": ["gpu"]}, "unknown tier"),
        ({"tier": {"gpu": 1}}, "unknown tier"),
        ({"backend": "vllm-1\n"}, "invalid backend"),
        ({"prefix_hash": HEX + "\n"}, "prefix_hash"),
        ({"prefix_hash": HEX.upper()}, "prefix_hash"),
        ({"token_count": True}, "token_count"),
        ({"token_count": -1}, "token_count"),
        ({"token_count": 1.5}, "token_count"),
    ],
)
def test_malformed_fields_name_the_field(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(EventError, match=message):
        KvEvent.from_json(orjson.dumps({**VALID, **patch}))


@pytest.mark.parametrize("data", [b"", b"{", b"\xff", b"[]", b"null", b'"cache_created"'])
def test_not_an_object(data: bytes) -> None:
    with pytest.raises(EventError):
        KvEvent.from_json(data)


@given(
    st.builds(
        KvEvent,
        st.sampled_from(["cache_created", "cache_evicted", "cache_offloaded"]),
        st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True),
        st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
        st.none() | st.integers(min_value=0, max_value=1 << 39),
        st.none() | st.sampled_from(["gpu", "storage"]),
        st.none() | st.text(max_size=10),
    )
)
def test_json_round_trip_is_exact_and_frozen(ev: KvEvent) -> None:
    back = KvEvent.from_json(ev.to_json())
    assert back == ev and hash(back) == hash(ev)
    with pytest.raises(AttributeError):
        back.event = "resync"  # type: ignore[misc]


def test_stream_backend_and_event_field_win() -> None:
    ev = KvEvent.from_json(orjson.dumps(VALID), event_field="cache_evicted", backend="other")
    assert (ev.event, ev.backend) == ("cache_evicted", "other")
    with pytest.raises(EventError, match="invalid backend"):
        KvEvent.from_json(orjson.dumps(VALID), backend="bad name")


# -- chain events (bus.prompt_chain keys) ------------------------------------------------

CHAIN = "cd" * 16
VALID_CHAIN: dict[str, Any] = {
    "event": "chain_created",
    "backend": "vllm-1",
    "chain_key": CHAIN,
    "token_count": 4100,
    "tier": "gpu",
}


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"chain_key": CHAIN + "ab"}, "chain_key"),
        ({"chain_key": CHAIN.upper()}, "chain_key"),
        ({"chain_key": HEX}, "chain_key"),  # a prefix key is not a chain key
        ({"chain_key": None}, "chain_key"),
        ({"token_count": None}, "needs a token_count"),
        ({"event": "chain_offloaded", "token_count": None}, "needs a token_count"),
    ],
)
def test_malformed_chain_events_name_the_field(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(EventError, match=message):
        KvEvent.from_json(orjson.dumps({**VALID_CHAIN, **patch}))


def test_a_chain_event_carries_its_key_and_no_prefix() -> None:
    ev = KvEvent.from_json(orjson.dumps({**VALID_CHAIN, "prefix_hash": HEX}))
    assert (ev.event, ev.chain_key, ev.prefix_hash, ev.token_count) == (
        "chain_created",
        CHAIN,
        None,
        4100,
    )
    gone = KvEvent.from_json(
        orjson.dumps({"event": "chain_evicted", "chain_key": CHAIN}), backend="b"
    )
    assert (gone.chain_key, gone.token_count) == (CHAIN, None)
    # A prefix event ignores a stray chain_key.
    assert KvEvent.from_json(orjson.dumps({**VALID, "chain_key": CHAIN})).chain_key is None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([*sorted(VALID_CHAIN), "reason"]), json_values)
def test_any_json_in_any_chain_field_is_an_event_or_an_event_error(field: str, value: Any) -> None:
    try:
        ev = KvEvent.from_json(orjson.dumps({**VALID_CHAIN, field: value}))
    except EventError:
        return
    if ev.event in ("chain_created", "chain_evicted", "chain_offloaded"):
        assert ev.chain_key == (value if field == "chain_key" else CHAIN)


@given(
    st.builds(
        KvEvent,
        st.sampled_from(["chain_created", "chain_offloaded"]),
        st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True),
        st.none(),
        st.integers(min_value=0, max_value=1 << 39),
        st.none() | st.sampled_from(["gpu", "storage"]),
        st.none(),
        st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
    )
)
def test_chain_json_round_trip_is_exact(ev: KvEvent) -> None:
    assert KvEvent.from_json(ev.to_json()) == ev


@given(json_values)
def test_a_resync_with_any_snapshot_size_is_a_resync(value: Any) -> None:
    """A resync is never dropped: a ``snapshot_size`` that is not a count reads as unsaid
    (the router then drops the backend at once instead of swapping a snapshot in)."""
    ev = KvEvent.from_json(
        orjson.dumps({"event": "resync", "backend": "b", "snapshot_size": value})
    )
    assert ev.event == "resync"
    ok = type(value) is int and 0 <= value < 1 << 40
    assert ev.snapshot_size == (value if ok else None)


@given(st.none() | st.integers(min_value=0, max_value=1 << 39))
def test_resync_snapshot_size_round_trips_and_only_on_resync(size: int | None) -> None:
    ev = KvEvent("resync", "b", reason="restart", snapshot_size=size)
    assert KvEvent.from_json(ev.to_json()) == ev
    other = orjson.dumps({**VALID, "snapshot_size": 3})
    assert KvEvent.from_json(other).snapshot_size is None


@pytest.mark.parametrize(
    ("obj", "incomplete"),
    [
        ({"event": "resync", "backend": "b", "incomplete": True}, True),
        ({"event": "resync", "backend": "b"}, False),
        ({"event": "resync", "backend": "b", "incomplete": 1}, False),  # only JSON true
        ({"event": "resync", "backend": "b", "incomplete": "yes"}, False),
        ({**VALID, "incomplete": True}, False),  # only a resync says it
    ],
)
def test_incomplete_is_read_from_a_resync_only(obj: dict[str, Any], incomplete: bool) -> None:
    assert KvEvent.from_json(orjson.dumps(obj)).incomplete is incomplete


def test_incomplete_round_trips_and_is_absent_when_false() -> None:
    ev = KvEvent("resync", "b", reason="checkpoint_gap", incomplete=True)
    assert b'"incomplete":true' in ev.to_json()
    assert KvEvent.from_json(ev.to_json()) == ev
    assert b"incomplete" not in KvEvent("resync", "b", reason="gap").to_json()
