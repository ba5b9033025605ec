"""The ``continuum.bus.v1.EventBus`` servicer: Session and Stream calls onto the session registry.

Admission, before anything else: a call beyond ``max_sessions`` / ``max_streams`` calls
in progress (authenticated or not) ends RESOURCE_EXHAUSTED; then the credentials in the
call's metadata are judged (``auth``), before any message is read, so an unauthenticated
peer never gets a message of up to ``max_message_bytes`` buffered. An admitted caller is
sent the initial metadata at once: the listener waits for it before its first message
(Hello, StreamOpen), so a refusal never races that write (a write in flight when the
call ends is reported by the peer's gRPC core as INTERNAL, hiding the status).

Every refusal ends the call with a status code and a detail an operator can act on (the
codes are listed in ``bus.proto``). A message that does not parse reaches the servicer as
:class:`Malformed` (the deserializers are wrapped by :func:`lenient`) and ends the call
INVALID_ARGUMENT naming the parse error: left to gRPC, the parse error would end it
UNKNOWN with a Python exception's text, or, after a Hello, look like a failed transport.
A malformed call never affects other calls: each is its own task, and a failure in one
ends only that one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
from bus.grpc_server import abort
from bus.stream_data import CLOSE_REASON_WORDS
from bus.tasks import cancel_and_wait

from .auth import AuthError, Principal
from .sessions import BusSession, ChannelClosed, SessionEnd, SessionRegistry

__all__ = ["EventBusServicer", "Malformed", "lenient"]

log = logging.getLogger("continuum.eventbus")

_FIRST_TIMEOUT_S = 10.0
"""How long a new call may take to send its first message (Hello, StreamOpen)."""

T = TypeVar("T")


class Malformed:
    """A request message that did not parse, in the message's place."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def lenient(parse: Callable[[bytes], T]) -> Callable[[bytes], T | Malformed]:
    """``parse`` as a request deserializer that hands a parse error to the servicer."""

    @functools.wraps(parse)
    def parse_or_malformed(raw: bytes) -> T | Malformed:
        try:
            return parse(raw)
        except Exception as exc:  # DecodeError, or the copy-free decoder's own
            return Malformed(f"{type(exc).__name__}: {exc}"[:200])

    return parse_or_malformed


def _unparsed(what: str, msg: Malformed) -> AuthError:
    return AuthError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} does not parse: {msg.error}")


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: AuthError) -> NoReturn:
    await abort(context, err.code, err.detail)


class EventBusServicer(pb_grpc.EventBusServicer):
    """The EventBus methods over one session registry.

    Args:
        sessions: the registry the calls register in.
        max_sessions, max_streams: calls of each method in progress at once.
    """

    def __init__(
        self, sessions: SessionRegistry, *, max_sessions: int = 256, max_streams: int = 4096
    ) -> None:
        self.sessions = sessions
        self._caps = {
            "Session": (max_sessions, "max_sessions"),
            "Stream": (max_streams, "max_streams"),
        }
        self.active = {"Session": 0, "Stream": 0}
        """Calls in progress, per method."""

    async def _admit(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Take one of ``method``'s slots (give it back with ``active[method] -= 1``)."""
        cap, name = self._caps[method]
        if self.active[method] >= cap:
            self.sessions.counters["calls_over_cap"] += 1
            log.warning(
                "event bus: refused a %s call from %s: %d in progress", method, context.peer(), cap
            )
            await _abort(
                context,
                AuthError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{cap} {method} calls in progress, the most"
                    f" dynamo.event_bus.{name} ({cap}) allows; retry later",
                ),
            )
        self.active[method] += 1

    async def _principal(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        try:
            return self.sessions.auth.authenticate(
                context.invocation_metadata() or (), context.auth_context()
            )
        except AuthError as err:
            self.sessions.counters["sessions_rejected"] += 1
            log.warning("event bus: refused a call from %s: %s", context.peer(), err.detail)
            await _abort(context, err)

    async def _first(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """The call's first message (Hello, StreamOpen), once the caller is authenticated."""
        try:
            async with asyncio.timeout(_FIRST_TIMEOUT_S):
                first = await anext(requests, None)
        except TimeoutError:
            await _abort(
                context,
                AuthError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no first message within {_FIRST_TIMEOUT_S:g} s",
                ),
            )
        if isinstance(first, Malformed):
            await _abort(context, _unparsed("the call's first message", first))
        return first

    # -- Session -------------------------------------------------------------------------

    async def Session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest | Malformed],
        context: grpc.aio.ServicerContext[pb.SessionRequest, pb.SessionResponse],
    ) -> None:
        await self._admit("Session", context)
        try:
            await self._session(request_iterator, context)
        finally:
            self.active["Session"] -= 1

    async def _session(
        self,
        request_iterator: AsyncIterator[pb.SessionRequest | Malformed],
        context: grpc.aio.ServicerContext[pb.SessionRequest, pb.SessionResponse],
    ) -> None:
        principal = await self._principal(context)
        await context.send_initial_metadata(())
        requests = aiter(request_iterator)
        first = await self._first(requests, context)
        if first is None or first.WhichOneof("kind") != "hello":
            await _abort(
                context,
                AuthError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the first Session message must be a Hello"
                ),
            )
        try:
            session = self.sessions.register(principal, first.hello)
        except AuthError as err:
            self.sessions.counters["sessions_rejected"] += 1
            log.warning("event bus: refused a Hello from %s: %s", context.peer(), err.detail)
            await _abort(context, err)
        reader = asyncio.get_running_loop().create_task(self._read(session, requests))
        try:
            await context.write(
                pb.SessionResponse(
                    welcome=pb.Welcome(session_id=session.id, accepted_sources=session.accepted)
                )
            )
            while True:
                msg = await session.outbox.get()
                if isinstance(msg, SessionEnd):
                    if msg.forbidden is not None:
                        await context.write(pb.SessionResponse(forbidden=msg.forbidden))
                    if msg.code != grpc.StatusCode.OK:
                        await context.abort(msg.code, msg.detail)
                    return
                await context.write(msg)
        finally:
            await cancel_and_wait(reader)
            self.sessions.unregister(session)

    async def _read(
        self, session: BusSession, requests: AsyncIterator[pb.SessionRequest | Malformed]
    ) -> None:
        """The listener's side of a session: snapshot answers, Draining, then half-close."""
        end = SessionEnd(grpc.StatusCode.OK, "the listener closed the session")
        try:
            async for req in requests:
                if isinstance(req, Malformed):
                    err = _unparsed("a SessionRequest", req)
                    end = SessionEnd(err.code, err.detail)
                    break
                kind = req.WhichOneof("kind")
                if kind == "draining":
                    self.sessions.draining(session)
                    # Its streams end with CLOSE_REASON_DRAINING; consumers move elsewhere.
                elif kind == "snapshot":
                    self.sessions.snapshot_chunk(session, req.snapshot)
                else:
                    end = SessionEnd(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "only Draining and SnapshotChunk may follow the Hello"
                        if kind == "hello"
                        else "empty SessionRequest",
                    )
                    break
        except Exception as exc:  # the transport failed: the session is over
            end = SessionEnd(grpc.StatusCode.UNAVAILABLE, f"session read failed: {exc}")
        session.send(end)

    # -- Stream --------------------------------------------------------------------------

    async def Stream(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest | bytes | Malformed],
        context: grpc.aio.ServicerContext[pb.StreamRequest, pb.StreamResponse],
    ) -> pb.StreamResponse:
        await self._admit("Stream", context)
        try:
            return await self._stream(request_iterator, context)
        finally:
            self.active["Stream"] -= 1

    async def _stream(
        self,
        request_iterator: AsyncIterator[pb.StreamRequest | bytes | Malformed],
        context: grpc.aio.ServicerContext[pb.StreamRequest, pb.StreamResponse],
    ) -> pb.StreamResponse:
        principal = await self._principal(context)
        await context.send_initial_metadata(())
        requests = aiter(request_iterator)
        first = await self._first(requests, context)
        if first is None or type(first) is bytes or first.WhichOneof("kind") != "open":
            await _abort(
                context,
                AuthError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "the first Stream message must be a StreamOpen",
                ),
            )
        try:
            slot = self.sessions.claim(principal, first.open.stream_id)
        except AuthError as err:
            log.warning("event bus: refused a Stream from %s: %s", context.peer(), err.detail)
            await _abort(context, err)
        channel = slot.channel
        detail = ""
        reason = "error"
        try:
            async for req in requests:
                # bus.stream_data hands a canonical data message over as its payload.
                if isinstance(req, bytes):
                    data = req
                elif isinstance(req, Malformed):
                    channel.close("protocol error")
                    await _abort(context, _unparsed("a StreamRequest", req))
                else:
                    kind = req.WhichOneof("kind")
                    if kind == "close":
                        reason = CLOSE_REASON_WORDS.get(req.close.reason, "error")
                        detail = req.close.detail[:500]
                        break
                    if kind != "data":
                        channel.close("protocol error")
                        await _abort(
                            context,
                            AuthError(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                "a second StreamOpen" if kind == "open" else "empty StreamRequest",
                            ),
                        )
                    data = req.data.data
                slot.bytes_received += len(data)
                if data:
                    await channel.put(data)
            else:
                detail = "the listener half-closed without StreamClose"
        except ChannelClosed as closed:
            log.info(
                "event bus: stream %s of %s ended by the router: %s",
                slot.stream_id,
                slot.source,
                closed,
            )
            await context.abort(
                grpc.StatusCode.ABORTED, f"the router ended stream {slot.stream_id}: {closed}"
            )
        finally:
            channel.end(reason, detail)
        return pb.StreamResponse(stream_id=slot.stream_id, bytes_received=slot.bytes_received)
