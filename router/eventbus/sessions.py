"""The session registry: which listener announces which source, and the streams in flight.

State (all touched on the event loop thread only, never across an ``await`` that could
interleave an inconsistent view):

* ``sessions``: one live :class:`BusSession` per ``client_id`` (a newer Hello with the same
  client_id replaces the older session, which ends with ABORTED: a restarted listener
  must not wait for its half-dead predecessor to time out).
* ``slots``: one :class:`StreamSlot` per issued ``Subscribe.stream_id``; single use. A
  slot belongs to one session and one source.

The consumer of source X (``router.ingest.KvEventConsumer``) gets its bytes from
:meth:`SessionRegistry.opener`:

1. pick the newest live, non-draining session that announced X; none: raise
   :class:`NoSession` (the consumer retries at a flat ``reconnect_interval_ms``);
2. issue a stream id, send ``Subscribe{stream_id, X, last_event_id}`` down the session;
3. wait until the listener's ``Stream`` call presents that id (``StreamOpen``), then yield
   the ``StreamData`` bytes as they arrive, through a small bounded channel: a consumer
   that stops reading stops the Stream call's reads, HTTP/2 flow control stops the
   listener's writes, and the listener's own bounded subscriber queue ends the stream
   with ``buffer_overflow`` instead of buffering without bound;
4. the stream ends with the listener's close reason (``buffer_overflow``, ``draining``,
   ``unsubscribed``, ``error``) or because its session ended; every end is raised to the
   consumer as :class:`router.ingest.StreamClosedByPeer`, so it resubscribes
   from its last applied event id (to another session when this one is draining or gone).

Hand-over on drain: when a session says ``Draining`` (or a new session arrives while one
drains), every stream of a draining session whose source another live session announces
is closed at once with ``draining``, and an ``Unsubscribe`` goes to the draining
listener: the consumer resubscribes from its last applied event id to the live session
instead of waiting for the draining listener to close the stream within its
``drain_deadline``. A stream nobody else can serve stays with the draining listener until
it closes it.

Snapshots (:meth:`SessionRegistry.snapshot`, for the anti-entropy check of a push-mode
source, which cannot fetch the listener's ``GET /snapshot/{backend}``): a
``SnapshotRequest`` goes down the session serving the source's stream (else the one a
Subscribe would pick), and the listener's ``SnapshotChunk`` messages on that session are
gathered, bounded by ``max_bytes``, until the last one; the request is forgotten when it
times out or its session ends (a late chunk is ignored).

If the consumer drops the stream itself (its SSE parser rejected the bytes, its apply
failed, it was cancelled), the slot is closed with that reason: the Stream call is ended
with a status naming it, and an ``Unsubscribe`` goes down the session.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import secrets
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.errors import BUFFER_OVERFLOW
from bus.stream_data import CLOSE_REASON_WORDS

from ..config.models import BrokerConfig, EventBusConfig
from ..ingest import ConsumerError, SourceUnavailable, StreamClosedByPeer, StreamOpener
from ..ingest.snapshot import SnapshotError
from .auth import Authenticator, AuthError, Principal

__all__ = ["BusSession", "NoSession", "SessionRegistry", "StreamSlot", "close_label"]

log = logging.getLogger("continuum.eventbus")

_SOURCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_CLOSE_LABELS = frozenset(CLOSE_REASON_WORDS.values())


def close_label(reason: str) -> str:
    """The ``stream_closes`` key of a peer's close reason: its first word when that is a
    close reason word (``bus.stream_data.CLOSE_REASON_WORDS``), else ``other``. The text
    comes from the listener's bytes; as a metric label it must stay a closed set."""
    word = reason.split(" ", 1)[0]
    return word if word in _CLOSE_LABELS else "other"


_ROLES = {"kv_listener": pb.ROLE_KV_LISTENER, "broker": pb.ROLE_BROKER}


class NoSession(SourceUnavailable):
    """No live listener session announces the source (yet)."""

    def __init__(self, source: str) -> None:
        super().__init__(f"no_session: no live listener session announces {source!r}")
        self.source = source


class ChannelClosed(Exception):
    """The consumer side of a stream is gone; ``reason`` says why."""


class _Channel:
    """Bounded single-producer single-consumer hand-off of byte chunks."""

    __slots__ = ("_items", "_max", "_readable", "_writable", "closed", "end_detail", "ended")

    def __init__(self, maxsize: int) -> None:
        self._items: deque[bytes] = deque()
        self._max = maxsize
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.ended: str | None = None
        """Producer side finished: the close reason word."""
        self.end_detail = ""
        self.closed: str | None = None
        """Consumer side finished: why."""

    async def put(self, data: bytes) -> None:
        while len(self._items) >= self._max and self.closed is None:
            self._writable.clear()
            await self._writable.wait()
        if self.closed is not None:
            raise ChannelClosed(self.closed)
        self._items.append(data)
        self._readable.set()

    def end(self, reason: str, detail: str = "") -> None:
        if self.ended is None:
            self.ended = reason
            self.end_detail = detail
            self._readable.set()

    def close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
            self._items.clear()
            self._writable.set()

    async def get(self) -> bytes | None:
        """The next chunk, or None once the producer ended and everything was read."""
        while not self._items:
            if self.ended is not None:
                return None
            self._readable.clear()
            await self._readable.wait()
        data = self._items.popleft()
        if len(self._items) < self._max:
            self._writable.set()
        return data


@dataclass(eq=False)
class StreamSlot:
    """One issued Subscribe and, once opened, its Stream call."""

    stream_id: str
    source: str
    session: BusSession
    last_event_id: str
    channel: _Channel
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False
    bytes_received: int = 0


@dataclass(eq=False)
class _SnapshotWait:
    """One SnapshotRequest's answer being gathered."""

    max_bytes: int
    future: asyncio.Future[bytes]
    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    def add(self, chunk: pb.SnapshotChunk) -> None:
        if self.future.done():
            return
        if chunk.error:
            self.future.set_exception(SnapshotError(f"the listener: {chunk.error[:200]}"))
            return
        self.size += len(chunk.data)
        if self.size > self.max_bytes:
            self.future.set_exception(SnapshotError(f"snapshot larger than {self.max_bytes} bytes"))
            return
        self.parts.append(chunk.data)
        if chunk.last:
            self.future.set_result(b"".join(self.parts))


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """Put in a session's outbox to end it: optional Forbidden, then ``code``."""

    code: grpc.StatusCode
    detail: str
    forbidden: pb.Forbidden | None = None


@dataclass(eq=False)
class BusSession:
    """One listener process's control channel."""

    id: str
    principal: Principal
    client_id: str
    role: str
    sources: frozenset[str]
    accepted: tuple[str, ...]
    outbox: asyncio.Queue[pb.SessionResponse | SessionEnd] = field(default_factory=asyncio.Queue)
    slots: dict[str, StreamSlot] = field(default_factory=dict)
    snapshots: dict[str, _SnapshotWait] = field(default_factory=dict)
    draining: bool = False
    ended: bool = False

    def send(self, msg: pb.SessionResponse | SessionEnd) -> None:
        if not self.ended:
            self.outbox.put_nowait(msg)
        if isinstance(msg, SessionEnd):
            self.ended = True


class SessionRegistry:
    """Sessions, stream slots and the consumers' openers (see the module docstring).

    Args:
        brokers: ``dynamo.event_bus.brokers``; replace with :meth:`update_brokers`.
        sources: Backends configured with ``transport: event_bus`` (Welcome's
            accepted_sources are the announced ones among these).
        certificates: Client certificates are verified (``tls.client_ca`` set).
        open_timeout: Seconds a Subscribe may wait for its StreamOpen.
        channel_chunks: StreamData messages buffered per stream between the Stream call
            and the consumer.
    """

    def __init__(
        self,
        brokers: Sequence[BrokerConfig],
        sources: Iterable[str] = (),
        *,
        certificates: bool = False,
        open_timeout: float = 10.0,
        channel_chunks: int = 8,
    ) -> None:
        self.auth = Authenticator(brokers, certificates=certificates)
        self.sources = frozenset(sources)
        self.open_timeout = open_timeout
        self.channel_chunks = channel_chunks
        self.sessions: dict[str, BusSession] = {}
        self.slots: dict[str, StreamSlot] = {}
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        self._closed = False
        self.counters: dict[str, int] = {
            "sessions_opened": 0,
            "sessions_rejected": 0,
            "sessions_forbidden": 0,
            "subscribes": 0,
            "no_session": 0,
            "calls_over_cap": 0,
            "drain_handovers": 0,
            "snapshot_requests": 0,
            "snapshot_failures": 0,
        }
        self.stream_closes: dict[str, int] = {}
        """Streams ended, by reason: a close reason word (``buffer_overflow``, ``draining``,
        ``unsubscribed``, ``error``), ``rejected`` (the router dropped it) or ``other``."""

    @classmethod
    def from_config(cls, config: EventBusConfig, sources: Iterable[str] = ()) -> SessionRegistry:
        """The registry of ``dynamo.event_bus``: its brokers; client certificates verified when
        ``tls.client_ca`` is set. One per process: the KV consumers of ``sources`` open
        their streams from it and the bus server registers the listeners' sessions in it.
        """
        return cls(config.brokers, sources, certificates=bool(config.tls.client_ca))

    # -- sessions ------------------------------------------------------------------------

    def register(self, principal: Principal, hello: pb.Hello) -> BusSession:
        """Validate a Hello against the authenticated entry and open a session.

        Raises:
            AuthError: INVALID_ARGUMENT or PERMISSION_DENIED, naming what is wrong.
        """
        entry = principal.entry
        if self._closed:
            raise AuthError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        if hello.role == pb.ROLE_UNSPECIFIED:
            raise AuthError(grpc.StatusCode.INVALID_ARGUMENT, "Hello.role is not set")
        if hello.role not in pb.Role.values():  # proto3 keeps an unknown enum number as is
            raise AuthError(
                grpc.StatusCode.INVALID_ARGUMENT, f"Hello.role {hello.role} is not a Role"
            )
        if hello.role != _ROLES[entry.role]:
            raise AuthError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"broker entry {entry.id!r} has role {entry.role}; it cannot open a "
                f"{pb.Role.Name(hello.role)} session",
            )
        if hello.client_id != entry.id:
            raise AuthError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"Hello.client_id {hello.client_id!r} is not the credential's broker entry "
                f"{entry.id!r}",
            )
        for s in hello.sources:
            if not _SOURCE_RE.match(s):
                raise AuthError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"source {s[:80]!r} is not a source id ([A-Za-z0-9_-], 1-64 characters)",
                )
        sources = frozenset(hello.sources)
        allowed = set(entry.backends)
        denied = sorted(sources - allowed)
        if denied:
            raise AuthError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"source {denied[0]!r} is not in backends of broker entry {entry.id!r}",
            )
        old = self.sessions.get(entry.id)
        if old is not None:
            self._end(old, SessionEnd(grpc.StatusCode.ABORTED, "replaced by a newer session"))
        session = BusSession(
            id=f"{self._prefix}-{next(self._ids)}",
            principal=principal,
            client_id=entry.id,
            role=entry.role,
            sources=sources,
            accepted=tuple(sorted(sources & self.sources)),
        )
        self.sessions[entry.id] = session
        self.counters["sessions_opened"] += 1
        for other in list(self.sessions.values()):
            if other.draining:
                self._hand_over(other)
        log.info(
            "event bus: session %s of %s (%s, %s) announces %s",
            session.id,
            entry.id,
            entry.role,
            principal.method,
            ", ".join(sorted(sources)) or "nothing",
        )
        return session

    def draining(self, session: BusSession) -> None:
        """The listener is shutting down: no new Subscribe goes to this session."""
        if not session.draining:
            session.draining = True
            log.info("event bus: session %s of %s is draining", session.id, session.client_id)
        self._hand_over(session)

    def _hand_over(self, session: BusSession) -> None:
        """Close the draining ``session``'s streams that a live session can serve, at once
        (module docstring): their consumers resubscribe there from their last event id."""
        for slot in list(session.slots.values()):
            target = self._pick(slot.source)
            if target is None or slot.channel.ended is not None:
                continue
            why = f"session {session.id} is draining; moving to session {target.id}"
            slot.channel.close(why)
            slot.channel.end("draining", why)
            slot.opened.set()
            self.counters["drain_handovers"] += 1
            session.send(
                pb.SessionResponse(unsubscribe=pb.Unsubscribe(stream_id=slot.stream_id, reason=why))
            )
            log.info("event bus: %s stream %s: %s", slot.source, slot.stream_id, why)

    def unregister(self, session: BusSession) -> None:
        """The session's call is over: end its streams so their consumers resubscribe."""
        session.ended = True
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        for slot in list(session.slots.values()):
            slot.channel.end("session_ended", f"session {session.id} ended")
            slot.opened.set()
        self._fail_snapshots(session, f"session {session.id} ended")
        log.info("event bus: session %s of %s ended", session.id, session.client_id)

    def _end(self, session: BusSession, end: SessionEnd) -> None:
        session.send(end)
        for slot in list(session.slots.values()):
            slot.channel.end("session_ended", end.detail)
            slot.opened.set()
        self._fail_snapshots(session, end.detail)

    @staticmethod
    def _fail_snapshots(session: BusSession, why: str) -> None:
        for wait in session.snapshots.values():
            if not wait.future.done():
                wait.future.set_exception(SnapshotError(f"no answer: {why}"))

    def update_brokers(self, brokers: Sequence[BrokerConfig]) -> None:
        """Hot reload: new credentials apply to new calls at once, and every session whose
        entry is gone, changed role or credential, or no longer lists an announced source
        ends with Forbidden (then PERMISSION_DENIED)."""
        self.auth.update(brokers)
        by_id = {b.id: b for b in brokers}
        for session in list(self.sessions.values()):
            old = session.principal.entry
            new = by_id.get(session.client_id)
            reason = None
            lost: list[str] = []
            if new is None:
                reason = f"broker entry {old.id!r} was removed"
            elif new.role != old.role:
                reason = f"broker entry {old.id!r} changed role to {new.role}"
            elif session.principal.method == "token" and new.token_hash != old.token_hash:
                reason = f"the token of broker entry {old.id!r} changed"
            else:
                lost = sorted(session.sources - set(new.backends))
                if lost:
                    reason = f"backends of broker entry {old.id!r} no longer include " + ", ".join(
                        repr(s) for s in lost
                    )
            if reason is not None:
                self.counters["sessions_forbidden"] += 1
                log.warning("event bus: ending session %s: %s", session.id, reason)
                forbidden = pb.Forbidden(reason=reason, sources=lost)
                self._end(session, SessionEnd(grpc.StatusCode.PERMISSION_DENIED, reason, forbidden))
                del self.sessions[session.client_id]

    def update_sources(self, sources: Iterable[str]) -> None:
        """Hot reload of the ``transport: event_bus`` sources: new sessions and every
        live one serve the new set at once (a live session's accepted sources are the ones
        it announced among them); the consumers of removed sources are stopped by the
        reload itself."""
        self.sources = frozenset(sources)
        for session in self.sessions.values():
            session.accepted = tuple(sorted(session.sources & self.sources))

    def close(self) -> None:
        """Router shutdown: end every session with UNAVAILABLE. Idempotent."""
        self._closed = True
        for session in list(self.sessions.values()):
            self._end(
                session, SessionEnd(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
            )
        self.sessions.clear()

    # -- streams -------------------------------------------------------------------------

    def claim(self, principal: Principal, stream_id: str) -> StreamSlot:
        """Bind a Stream call to its Subscribe.

        Raises:
            AuthError: INVALID_ARGUMENT (empty id), NOT_FOUND (unknown, used, or ended) or
                PERMISSION_DENIED (issued to another client).
        """
        if not stream_id:
            raise AuthError(grpc.StatusCode.INVALID_ARGUMENT, "StreamOpen.stream_id is empty")
        slot = self.slots.get(stream_id)
        if slot is None or slot.claimed or slot.channel.ended or slot.channel.closed:
            raise AuthError(
                grpc.StatusCode.NOT_FOUND,
                f"stream id {stream_id[:64]!r} was never issued, was already used, or ended",
            )
        if slot.session.client_id != principal.entry.id:
            raise AuthError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"stream id {stream_id!r} belongs to another client's session",
            )
        slot.claimed = True
        slot.opened.set()
        return slot

    def _pick(self, source: str) -> BusSession | None:
        live = [
            s
            for s in self.sessions.values()
            if source in s.accepted and not s.draining and not s.ended
        ]
        return live[-1] if live else None

    def opener(self, source: str) -> StreamOpener:
        """The ``StreamOpener`` of the consumer of ``source`` (module docstring)."""

        def open_stream(last_event_id: str | None) -> AsyncIterator[bytes]:
            return self._stream(source, last_event_id)

        return open_stream

    async def _stream(self, source: str, last_event_id: str | None) -> AsyncIterator[bytes]:
        session = self._pick(source)
        if session is None:
            self.counters["no_session"] += 1
            raise NoSession(source)
        stream_id = secrets.token_urlsafe(12)
        slot = StreamSlot(
            stream_id, source, session, last_event_id or "", _Channel(self.channel_chunks)
        )
        self.slots[stream_id] = slot
        session.slots[stream_id] = slot
        self.counters["subscribes"] += 1
        session.send(
            pb.SessionResponse(
                subscribe=pb.Subscribe(
                    stream_id=stream_id, source=source, last_event_id=last_event_id or ""
                )
            )
        )
        why = "the router's consumer closed the stream"
        try:
            try:
                async with asyncio.timeout(self.open_timeout):
                    await slot.opened.wait()
            except TimeoutError:
                raise ConsumerError(
                    f"listener session {session.id} did not open stream {stream_id} within "
                    f"{self.open_timeout:g}s"
                ) from None
            if slot.channel.ended is not None:
                raise StreamClosedByPeer(slot.channel.ended)
            yield b""
            channel = slot.channel
            while True:
                chunk = await channel.get()
                if chunk is None:
                    break
                yield chunk
            reason = channel.ended or "error"
            raise StreamClosedByPeer(
                reason + (f" ({channel.end_detail})" if channel.end_detail else "")
            )
        except Exception as exc:
            # The consumer throws the error that ended its connection in here (athrow):
            # the listener's close (StreamClose, or the SSE error record that precedes a
            # buffer_overflow close), or the router's own reason to drop the stream.
            if isinstance(exc, StreamClosedByPeer):
                reason = close_label(exc.reason)
                if reason == BUFFER_OVERFLOW:
                    log.warning("event bus: %s stream closed by the listener: %s", source, reason)
            else:
                reason = "rejected"
                why = f"the router closed the stream: {exc}"
            self.stream_closes[reason] = self.stream_closes.get(reason, 0) + 1
            raise
        finally:
            self.slots.pop(stream_id, None)
            session.slots.pop(stream_id, None)
            if slot.channel.ended is None:
                slot.channel.close(why)
                slot.channel.end("unsubscribed")
                session.send(
                    pb.SessionResponse(unsubscribe=pb.Unsubscribe(stream_id=stream_id, reason=why))
                )

    # -- snapshots -----------------------------------------------------------------------

    async def snapshot(
        self,
        source: str,
        within: float,
        max_bytes: int = 256 << 20,
    ) -> bytes:
        """The JSON body of ``source``'s snapshot from the listener serving it (module
        docstring).

        Raises:
            NoSession: no live session announces ``source``.
            SnapshotError: the listener could not answer, the answer exceeded
                ``max_bytes``, or the session ended first.
            TimeoutError: no full answer within ``within`` seconds.
        """
        serving = [s.session for s in self.slots.values() if s.source == source and s.claimed]
        session = serving[-1] if serving and not serving[-1].ended else self._pick(source)
        if session is None:
            raise NoSession(source)
        request_id = secrets.token_urlsafe(9)
        wait = _SnapshotWait(max_bytes, asyncio.get_running_loop().create_future())
        session.snapshots[request_id] = wait
        self.counters["snapshot_requests"] += 1
        session.send(
            pb.SessionResponse(
                snapshot_request=pb.SnapshotRequest(request_id=request_id, source=source)
            )
        )
        try:
            async with asyncio.timeout(within):
                return await wait.future
        except BaseException:
            self.counters["snapshot_failures"] += 1
            raise
        finally:
            session.snapshots.pop(request_id, None)

    def snapshot_chunk(self, session: BusSession, chunk: pb.SnapshotChunk) -> None:
        """A piece of an answer, from ``session``'s listener (an unknown or forgotten
        request id is ignored: a late answer)."""
        wait = session.snapshots.get(chunk.request_id)
        if wait is not None:
            wait.add(chunk)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "stream_closes": dict(self.stream_closes),
            "sessions": [
                {
                    "session_id": s.id,
                    "client_id": s.client_id,
                    "role": s.role,
                    "sources": sorted(s.sources),
                    "accepted_sources": list(s.accepted),
                    "draining": s.draining,
                    "open_streams": len(s.slots),
                }
                for s in self.sessions.values()
            ],
        }
