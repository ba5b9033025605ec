"""The router's event bus state machine (``router/eventbus``), without sockets.

Authentication per broker entry, Hello validation, session replacement, Forbidden on a
reload that shrinks an entry, stream-id claims, and the consumer-facing opener: bytes in
order, close reasons raised as such, Unsubscribe when the consumer drops the stream, and
``no_session`` retried at a flat interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.backoff import NoBackoff
from certs import dev_bundle
from router.config.models import BrokerConfig, EventSourceConfig
from router.eventbus.auth import Authenticator, AuthError, dns_sans, hash_token
from router.eventbus.sessions import ChannelClosed, NoSession, SessionEnd, SessionRegistry
from router.ingest import KvEventConsumer, StreamClosedByPeer

A, B = "vllm-1", "vllm-2"


def entry(eid: str = "kv-a", backends: tuple[str, ...] = (A, B), **kw: Any) -> BrokerConfig:
    data = {"id": eid, "role": "kv_listener", "backends": list(backends), **kw}
    data.setdefault("token_hash", hash_token(f"tok-{eid}"))
    return BrokerConfig.model_validate(data)


def md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def hello(
    cid: str = "kv-a", sources: tuple[str, ...] = (A,), role: pb.Role = pb.ROLE_KV_LISTENER
) -> pb.Hello:
    return pb.Hello(client_id=cid, role=role, sources=sources)


# -- auth ----------------------------------------------------------------------------------


def test_hash_token_is_the_documented_form() -> None:
    # printf %s "secret" | sha256sum
    assert hash_token("secret") == (
        "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
    )


def test_token_auth_picks_the_matching_entry() -> None:
    auth = Authenticator([entry("kv-a"), entry("kv-b")], certificates=False)
    assert auth.authenticate(md("tok-kv-b"), {}).entry.id == "kv-b"
    assert auth.authenticate([("Authorization", "bearer tok-kv-a")], {}).entry.id == "kv-a"
    for bad in (md("tok-kv-c"), md(""), [("authorization", "Basic abc")], []):
        with pytest.raises(AuthError) as info:
            auth.authenticate(bad, {})
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_certificate_auth_uses_dns_sans_only_when_verified(tmp_path: Any) -> None:
    bundle = dev_bundle(tmp_path, clients=["kv-a", "intruder"])
    pem_a = bundle["kv-a"].cert.read_bytes()
    ctx = {"x509_pem_cert": [pem_a]}
    assert dns_sans(pem_a) == ["kv-a"]
    assert dns_sans(b"not a certificate") == []
    e = entry("kv-a", token_hash=None)
    assert Authenticator([e], certificates=True).authenticate([], ctx).method == "certificate"
    with pytest.raises(AuthError, match="no credential"):
        Authenticator([e], certificates=False).authenticate([], ctx)
    with pytest.raises(AuthError, match=r"\['intruder'\] match no broker entry id"):
        Authenticator([e], certificates=True).authenticate(
            [], {"x509_pem_cert": [bundle["intruder"].cert.read_bytes()]}
        )
    # A wrong token is refused even when the certificate would match.
    with pytest.raises(AuthError, match="bearer token matches no"):
        Authenticator([e], certificates=True).authenticate(md("nope"), ctx)
    # Only DNS SANs count: the server certificate's IP SANs are left out.
    assert dns_sans(bundle["server"].cert.read_bytes()) == ["localhost"]


# -- sessions ------------------------------------------------------------------------------


def _registry(*entries: BrokerConfig, sources: tuple[str, ...] = (A, B)) -> SessionRegistry:
    return SessionRegistry(list(entries) or [entry()], sources, open_timeout=1.0)


def _principal(registry: SessionRegistry, eid: str = "kv-a") -> Any:
    return registry.auth.authenticate(md(f"tok-{eid}"), {})


@pytest.mark.parametrize(
    ("msg", "code", "text"),
    [
        (
            hello(role=pb.ROLE_UNSPECIFIED),
            grpc.StatusCode.INVALID_ARGUMENT,
            "Hello.role is not set",
        ),
        (hello(role=pb.ROLE_BROKER), grpc.StatusCode.PERMISSION_DENIED, "has role kv_listener"),
        (
            hello(role=pb.Role.ValueType(77)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "Hello.role 77 is not a Role",
        ),
        (hello(cid="kv-b"), grpc.StatusCode.PERMISSION_DENIED, "is not the credential's"),
        (hello(sources=("x y",)), grpc.StatusCode.INVALID_ARGUMENT, "not a source id"),
        (hello(sources=(A, "vllm-9")), grpc.StatusCode.PERMISSION_DENIED, "'vllm-9' is not in"),
    ],
)
def test_bad_hellos_are_refused_and_leave_no_session(msg: pb.Hello, code: Any, text: str) -> None:
    registry = _registry()
    with pytest.raises(AuthError) as info:
        registry.register(_principal(registry), msg)
    assert info.value.code == code and text in info.value.detail
    assert registry.sessions == {}


async def test_welcome_accepts_configured_sources_and_a_newer_session_replaces() -> None:
    registry = _registry(sources=(B,))
    first = registry.register(_principal(registry), hello(sources=(A, B, B)))
    assert first.accepted == (B,)
    second = registry.register(_principal(registry), hello(sources=(B,)))
    end = first.outbox.get_nowait()
    assert isinstance(end, SessionEnd) and end.code == grpc.StatusCode.ABORTED
    assert registry.sessions == {"kv-a": second}


async def test_reloaded_sources_are_served_by_live_sessions_at_once() -> None:
    """A source added by a reload is subscribed over a session that announced it before
    (no reconnect); a removed one is no longer picked."""
    registry = _registry(sources=(B,))
    session = registry.register(_principal(registry), hello(sources=(A, B)))
    assert session.accepted == (B,)
    registry.update_sources([A, B])
    assert session.accepted == (A, B)
    assert registry._pick(A) is session
    registry.update_sources([A])
    assert session.accepted == (A,) and registry._pick(B) is None
    later = registry.register(_principal(registry), hello(sources=(A, B)))
    assert later.accepted == (A,)


async def test_reload_shrink_sends_forbidden_and_keeps_unaffected_sessions() -> None:
    registry = _registry(entry("kv-a"), entry("kv-b"))
    a = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A, B)))
    b = registry.register(_principal(registry, "kv-b"), hello("kv-b", (A,)))
    registry.update_brokers([entry("kv-a", (A,)), entry("kv-b", (A,))])
    end = a.outbox.get_nowait()
    assert isinstance(end, SessionEnd) and end.code == grpc.StatusCode.PERMISSION_DENIED
    assert end.forbidden is not None and list(end.forbidden.sources) == [B]
    assert "no longer include 'vllm-2'" in end.forbidden.reason
    assert b.outbox.empty() and registry.sessions == {"kv-b": b}
    # A removed entry and a changed token end sessions too.
    registry.update_brokers([entry("kv-b", (A,), token_hash=hash_token("rotated"))])
    end = b.outbox.get_nowait()
    assert isinstance(end, SessionEnd) and "token" in end.detail and registry.sessions == {}


# -- streams -------------------------------------------------------------------------------


async def _subscribed(
    registry: SessionRegistry, session: Any, opener: Any
) -> tuple[Any, pb.Subscribe]:
    it = opener("e-7")
    first = asyncio.ensure_future(anext(it))
    msg = await asyncio.wait_for(session.outbox.get(), 1)
    assert msg.WhichOneof("kind") == "subscribe"
    return (it, first), msg.subscribe


async def test_opener_streams_bytes_then_raises_the_close_reason() -> None:
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    (it, first), sub = await _subscribed(registry, session, registry.opener(A))
    assert sub.source == A and sub.last_event_id == "e-7"
    with pytest.raises(AuthError) as info:
        registry.claim(registry.auth.authenticate(md("tok-kv-a"), {}), "unknown")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    slot = registry.claim(_principal(registry), sub.stream_id)
    with pytest.raises(AuthError):  # single use
        registry.claim(_principal(registry), sub.stream_id)
    assert await first == b""  # open: the consumer counts as connected
    await slot.channel.put(b"id: 1\n")
    await slot.channel.put(b"data: x\n\n")
    slot.channel.end("draining")
    assert [await anext(it), await anext(it)] == [b"id: 1\n", b"data: x\n\n"]
    with pytest.raises(StreamClosedByPeer, match="draining"):
        await anext(it)
    assert registry.stream_closes == {"draining": 1} and registry.slots == {}


async def test_a_stream_id_of_another_client_is_permission_denied() -> None:
    registry = _registry(entry("kv-a"), entry("kv-b"))
    session = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A,)))
    _, sub = await _subscribed(registry, session, registry.opener(A))
    with pytest.raises(AuthError) as info:
        registry.claim(_principal(registry, "kv-b"), sub.stream_id)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_consumer_dropping_the_stream_unsubscribes_with_its_reason() -> None:
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    (it, first), sub = await _subscribed(registry, session, registry.opener(A))
    slot = registry.claim(_principal(registry), sub.stream_id)
    await first
    with pytest.raises(ValueError):
        await it.athrow(ValueError("SSE line longer than 1048576 bytes"))
    msg = session.outbox.get_nowait()
    assert isinstance(msg, pb.SessionResponse)
    assert msg.unsubscribe.stream_id == sub.stream_id
    assert "SSE line longer than 1048576 bytes" in msg.unsubscribe.reason
    with pytest.raises(ChannelClosed, match="SSE line longer"):
        await slot.channel.put(b"more")


async def test_session_end_ends_its_streams_and_draining_sessions_get_no_subscribe() -> None:
    registry = _registry(entry("kv-a"), entry("kv-b"))
    a = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A,)))
    (it, first), sub = await _subscribed(registry, a, registry.opener(A))
    registry.claim(_principal(registry), sub.stream_id)
    await first
    registry.unregister(a)
    with pytest.raises(StreamClosedByPeer, match="session_ended"):
        await anext(it)
    b = registry.register(_principal(registry, "kv-b"), hello("kv-b", (A,)))
    registry.draining(b)
    with pytest.raises(NoSession, match="no_session"):
        await anext(registry.opener(A)(None))


async def test_draining_hands_a_stream_over_to_another_session_at_once() -> None:
    registry = _registry(entry("kv-a"), entry("kv-b"))
    a = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A,)))
    b = registry.register(_principal(registry, "kv-b"), hello("kv-b", (A,)))
    # The newest session serves; make kv-b the one streaming, then drain it.
    (it, first), sub = await _subscribed(registry, b, registry.opener(A))
    slot = registry.claim(_principal(registry, "kv-b"), sub.stream_id)
    await first
    await slot.channel.put(b"id: 1\n")
    registry.draining(b)
    # Closed now (not when the listener closes it): buffered bytes are not delivered, the
    # consumer resumes from its last applied id, and the draining listener is told.
    with pytest.raises(StreamClosedByPeer, match="draining"):
        await anext(it)
    msg = b.outbox.get_nowait()
    assert isinstance(msg, pb.SessionResponse) and msg.unsubscribe.stream_id == sub.stream_id
    assert f"moving to session {a.id}" in msg.unsubscribe.reason
    with pytest.raises(ChannelClosed):
        await slot.channel.put(b"more")  # the Stream call ends (ABORTED)
    assert registry.counters["drain_handovers"] == 1
    assert registry.stream_closes == {"draining": 1}
    # The consumer's next open goes to the live session.
    (_it2, _first2), sub2 = await _subscribed(registry, a, registry.opener(A))
    assert sub2.source == A and b.outbox.empty()


async def test_draining_keeps_a_stream_nobody_else_serves_until_a_session_arrives() -> None:
    registry = _registry(entry("kv-a"), entry("kv-b"))
    a = registry.register(_principal(registry, "kv-a"), hello("kv-a", (A,)))
    (it, first), sub = await _subscribed(registry, a, registry.opener(A))
    slot = registry.claim(_principal(registry, "kv-a"), sub.stream_id)
    await first
    registry.draining(a)
    await slot.channel.put(b"id: 1\n")  # still served by the draining listener
    assert await anext(it) == b"id: 1\n"
    assert a.outbox.empty() and registry.counters["drain_handovers"] == 0
    b = registry.register(_principal(registry, "kv-b"), hello("kv-b", (A,)))
    with pytest.raises(StreamClosedByPeer, match="draining"):
        await anext(it)
    msg = a.outbox.get_nowait()
    assert isinstance(msg, pb.SessionResponse)
    assert f"moving to session {b.id}" in msg.unsubscribe.reason


async def test_subscribe_without_stream_open_times_out() -> None:
    registry = SessionRegistry([entry()], (A,), open_timeout=0.01)
    registry.register(_principal(registry), hello(sources=(A,)))
    with pytest.raises(Exception, match="did not open stream"):
        await anext(registry.opener(A)(None))


async def test_no_session_is_retried_at_a_flat_interval_without_doubling() -> None:
    registry = _registry()
    backoff = NoBackoff()
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == 5:
            raise asyncio.CancelledError

    async def apply(ev: Any) -> str:
        return "created"

    src = EventSourceConfig(backend_name=A, transport="event_bus")
    consumer = KvEventConsumer(
        src, apply, backoff=backoff, stream_opener=registry.opener(A), sleep=sleep
    )
    with pytest.raises(asyncio.CancelledError):
        await consumer.run()
    assert backoff.computed == [1] * 5  # never 2, 3, ...: flat
    assert consumer.stats.last_error is not None and "no_session" in consumer.stats.last_error
    assert registry.counters["no_session"] == 5


# -- chunking ------------------------------------------------------------------------------

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "push_stream_golden.sse"


async def _apply_through_bus(cuts: list[int]) -> list[tuple[str, str | None, int | None]]:
    """The golden stream cut at ``cuts`` into StreamData chunks, consumed by a real
    KvEventConsumer through the registry's opener; returns what it applied, in order."""
    data = GOLDEN.read_bytes()
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    applied: list[tuple[str, str | None, int | None]] = []
    done = asyncio.Event()

    async def apply(ev: Any) -> str:
        applied.append((ev.event, ev.prefix_hash, ev.token_count))
        if len(applied) == data.count(b"\n\n"):
            done.set()
        return "created"

    src = EventSourceConfig(backend_name=A, transport="event_bus")
    consumer = KvEventConsumer(src, apply, backoff=NoBackoff(), stream_opener=registry.opener(A))
    task = asyncio.ensure_future(consumer.run())
    try:
        msg = await asyncio.wait_for(session.outbox.get(), 1)
        assert isinstance(msg, pb.SessionResponse)
        slot = registry.claim(_principal(registry), msg.subscribe.stream_id)
        bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
        for lo, hi in itertools.pairwise(bounds):
            await slot.channel.put(data[lo:hi])
        await asyncio.wait_for(done.wait(), 2)
        last_id = data.rsplit(b"\nid: ", 1)[1].split(b"\n", 1)[0].decode()
        assert consumer.stats.last_event_id == last_id == "c0ffee00-12"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return applied


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=40))
def test_chunk_boundaries_carry_no_meaning(cuts: list[int]) -> None:
    whole = asyncio.run(_apply_through_bus([]))
    assert asyncio.run(_apply_through_bus(cuts)) == whole
    assert whole[0] == ("resync", None, None) and len(whole) == 17
    assert {kind for kind, _, _ in whole} >= {"chain_created", "chain_evicted", "chain_offloaded"}


@pytest.mark.parametrize(
    ("peer_reason", "label"),
    [
        ("buffer_overflow", "buffer_overflow"),
        ("draining (SIGTERM)", "draining"),
        ("unsubscribed", "unsubscribed"),
        ("error (boom)", "error"),
        ("x" * 200, "other"),
        ("tenant-42-secret oops", "other"),
        ("", "other"),
    ],
)
async def test_stream_close_counters_take_only_close_reason_words(
    peer_reason: str, label: str
) -> None:
    """The reason comes from the listener's bytes (the SSE error record's ``error``): as a
    metric label it must be one of a closed set, or every distinct text is a new series."""
    registry = _registry()
    session = registry.register(_principal(registry), hello(sources=(A,)))
    (it, first), sub = await _subscribed(registry, session, registry.opener(A))
    registry.claim(_principal(registry), sub.stream_id)
    await first
    with pytest.raises(StreamClosedByPeer):
        await it.athrow(StreamClosedByPeer(peer_reason))
    assert registry.stream_closes == {label: 1}


@given(st.text(max_size=40))
@settings(max_examples=50, deadline=None)
def test_stream_close_labels_are_a_closed_set(text: str) -> None:
    from router.eventbus.sessions import close_label

    assert close_label(text) in {"buffer_overflow", "draining", "unsubscribed", "error", "other"}
