"""The anti-entropy snapshot over the event bus session (``SessionRegistry.snapshot``),
without sockets: a ``SnapshotRequest`` goes down the session serving the source, the
chunks answering it are joined in order, and every way an answer can fail to come (an
error chunk, an oversized answer, a timeout, the session ending) fails the fetch and
leaves no pending request behind; a late chunk is ignored."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from router.eventbus.sessions import BusSession, NoSession, SessionEnd, SessionRegistry
from router.ingest.snapshot import SnapshotError, parse_snapshot

from .test_eventbus import A, B, _principal, _registry, entry, hello


async def _next(session: BusSession) -> pb.SessionResponse:
    msg = await asyncio.wait_for(session.outbox.get(), 1)
    assert isinstance(msg, pb.SessionResponse), msg
    return msg


async def _request(session: BusSession) -> pb.SnapshotRequest:
    msg = await _next(session)
    assert msg.WhichOneof("kind") == "snapshot_request", msg
    return msg.snapshot_request


async def _open_stream(registry: SessionRegistry, session: BusSession, eid: str) -> Any:
    """A consumer's stream of A, opened by ``session``'s listener."""
    it: Any = registry.opener(A)("")
    first = asyncio.ensure_future(anext(it))
    sub = (await _next(session)).subscribe
    registry.claim(_principal(registry, eid), sub.stream_id)
    await first
    return it


def _chunk(req: pb.SnapshotRequest | str, data: bytes = b"", **kw: Any) -> pb.SnapshotChunk:
    rid = req if isinstance(req, str) else req.request_id
    return pb.SnapshotChunk(request_id=rid, data=data, **kw)


async def test_chunks_are_joined_into_the_snapshot_document() -> None:
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A, B)))
    fetch = asyncio.ensure_future(registry.snapshot(A, within=2))
    req = await _request(session)
    assert req.source == A and req.request_id
    body = b'{"backend":"vllm-1","event_id":"e1-3","events":[]}'
    registry.snapshot_chunk(session, _chunk(req, body[:10]))
    registry.snapshot_chunk(session, _chunk("someone else's", b"{}", last=True))
    registry.snapshot_chunk(session, _chunk(req, body[10:], last=True))
    raw = await fetch
    assert raw == body and parse_snapshot(raw, A) == ("e1-3", [])
    assert session.snapshots == {} and registry.counters["snapshot_requests"] == 1
    registry.snapshot_chunk(session, _chunk(req, b"late", last=True))  # ignored
    assert registry.counters["snapshot_failures"] == 0


async def test_the_session_serving_the_stream_is_asked() -> None:
    """Two listeners announce A; the stream is on the older one, which a Subscribe would
    no longer pick: the snapshot must come from the listener the consumer reads (its event
    ids are the ones the check compares)."""
    registry = _registry(entry("kv-a"), entry("kv-b"), sources=(A,))
    older = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A,)))
    it = await _open_stream(registry, older, "kv-a")
    newer = registry.register(_principal(registry, "kv-b"), hello("kv-b", (A,)))
    assert registry._pick(A) is newer
    fetch = asyncio.ensure_future(registry.snapshot(A, within=2))
    req = await _request(older)
    registry.snapshot_chunk(older, _chunk(req, b"{}", last=True))
    assert await fetch == b"{}" and newer.outbox.empty()
    await it.aclose()


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        ([{"error": 'unknown source "vllm-1"', "last": True}], "the listener: unknown source"),
        ([{"data": b"x" * 600}, {"data": b"y" * 600, "last": True}], "larger than 1000 bytes"),
    ],
)
async def test_an_error_or_oversized_answer_fails_the_fetch(
    chunks: list[dict[str, Any]], error: str
) -> None:
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    fetch = asyncio.ensure_future(registry.snapshot(A, within=2, max_bytes=1000))
    req = await _request(session)
    for c in chunks:
        registry.snapshot_chunk(session, _chunk(req, **c))
    with pytest.raises(SnapshotError, match=error):
        await fetch
    assert session.snapshots == {} and registry.counters["snapshot_failures"] == 1


async def test_no_answer_times_out_and_a_session_end_fails_at_once() -> None:
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    with pytest.raises(TimeoutError):
        await registry.snapshot(A, within=0.05)
    late = await _request(session)
    registry.snapshot_chunk(session, _chunk(late, b"{}", last=True))  # forgotten: ignored
    assert session.snapshots == {}
    fetch = asyncio.ensure_future(registry.snapshot(A, within=30))
    await _request(session)
    replacement = registry.register(_principal(registry), hello(sources=(A,)))
    with pytest.raises(SnapshotError, match="replaced by a newer session"):
        await asyncio.wait_for(fetch, 1)
    assert isinstance(session.outbox.get_nowait(), SessionEnd)
    fetch = asyncio.ensure_future(registry.snapshot(A, within=30))
    await _request(replacement)
    registry.unregister(replacement)
    with pytest.raises(SnapshotError, match="ended"):
        await asyncio.wait_for(fetch, 1)
    with pytest.raises(NoSession):
        await registry.snapshot(A, within=1)
    assert registry.counters["snapshot_failures"] == 3


async def test_a_draining_listener_is_still_asked_for_the_stream_it_serves() -> None:
    """Only new Subscribes avoid a draining session; its open stream is still its own."""
    registry = _registry(sources=(A,))
    session = registry.register(_principal(registry), hello(sources=(A,)))
    it = await _open_stream(registry, session, "kv-a")
    registry.draining(session)
    fetch = asyncio.ensure_future(registry.snapshot(A, within=2))
    req = await _request(session)
    registry.snapshot_chunk(session, _chunk(req, b"{}", last=True))
    assert await fetch == b"{}"
    await it.aclose()
