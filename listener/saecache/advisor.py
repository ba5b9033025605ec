"""gRPC ``continuum.listener.v1.EvictionAdvisor``: SAECache advice for engines.

One :class:`~listener.saecache.policy.SaeCache` per backend, fed by ``Observe`` and
queried by ``RankVictims``. A request's session class is the engine's hint when it sends
one, else the class ``classify`` derives from the request's engine-visible features
(``BlockEvent.request``), else the session predictor's. The wire contract (kinds, limits,
status codes) is in ``proto/continuum/listener/v1/eviction_advisor.proto``.

Memory per backend is bounded: at most ``max_blocks`` blocks (beyond it the lowest-ranked
evictable blocks are forgotten, as if the engine had evicted them; when none is evictable
the backend's state is reset, which only costs advice quality), ``max_sessions``
sessions and ``ghost_capacity`` recently evicted hashes (``SaeConfig``).

A batch is validated whole before any of it is applied, so a bad event never leaves a
half-applied batch behind.

Clock: engine timestamps are seconds on any epoch, so they are related to the server's
monotonic clock: the first one fixes the offset between the two, and a later one more
than ``max_clock_skew`` away from ``server clock + offset`` (one event far in the future
would otherwise become the backend's "now" for good, make its block look freshest forever
and expire every session) is replaced by that estimate and counted (``clamped``). Within
the bound an engine's own timestamps keep their precision and order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from bus._gen.continuum.listener.v1 import eviction_advisor_pb2_grpc as pb_grpc

from .classify import RequestFeatures, classify, parse_features
from .guard import GuardConfig, GuardedSaeCache
from .policy import SaeCache, SaeConfig
from .predictor import Predictor
from .types import SessionClass, TokenType

__all__ = [
    "MAX_CANDIDATES",
    "MAX_EVENTS",
    "MAX_HASH_BYTES",
    "SERVICE_NAME",
    "EvictionAdvisor",
    "add_to_server",
    "request_features",
]

log = logging.getLogger("continuum.listener.saecache.advisor")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["EvictionAdvisor"].full_name
MAX_CANDIDATES = 65_536
MAX_EVENTS = 65_536
MAX_HASH_BYTES = 64

_TYPES = {
    pb.TOKEN_TYPE_UNSPECIFIED: TokenType.USER,
    pb.TOKEN_TYPE_SYSTEM: TokenType.SYSTEM,
    pb.TOKEN_TYPE_USER: TokenType.USER,
    pb.TOKEN_TYPE_ASSISTANT: TokenType.ASSISTANT,
    pb.TOKEN_TYPE_REASONING: TokenType.REASONING,
    pb.TOKEN_TYPE_TOOL_DEFINITION: TokenType.TOOL_DEF,
    pb.TOKEN_TYPE_TOOL_IO: TokenType.TOOL_IO,
}
_CLASSES = {
    pb.SESSION_CLASS_UNSPECIFIED: SessionClass.UNKNOWN,
    pb.SESSION_CLASS_CHAT: SessionClass.CHAT,
    pb.SESSION_CLASS_AGENT: SessionClass.AGENT,
    pb.SESSION_CLASS_SINGLE: SessionClass.SINGLE,
}
_KINDS = frozenset(range(1, 6))


class _InvalidArgument(ValueError):
    pass


class _Backend:
    __slots__ = ("cache", "clamped", "forgotten", "now", "offset")

    def __init__(self, cfg: SaeConfig, guard: GuardConfig | None) -> None:
        self.cache = SaeCache(cfg) if guard is None else GuardedSaeCache(cfg, guard)
        self.now = 0.0
        self.forgotten = 0
        self.offset: float | None = None
        """Engine clock minus server clock, from the first timestamp."""
        self.clamped = 0
        """Timestamps more than ``max_clock_skew`` off, replaced by the estimate."""


class EvictionAdvisor(pb_grpc.EvictionAdvisorServicer):
    """SAECache state per backend behind the EvictionAdvisor RPCs.

    Args:
        backends: the valid backend names (the listener's sources).
        max_blocks: blocks kept per backend.
        config: the SAECache configuration of every backend's state.
        predictor: the session predictor (``listener.saecache.predictor``): classifies a
            new session whose REQUEST_STARTED carries ``features`` and no class guess.
        max_clock_skew: seconds an engine timestamp may be off the server clock's estimate.
        clock: the server's clock (seconds, monotonic).
        guard: the safeguard's settings (``listener.saecache.guard``); None ranks by
            SAECache alone.
    """

    def __init__(
        self,
        backends: Iterable[str],
        *,
        max_blocks: int = 1_000_000,
        config: SaeConfig | None = None,
        predictor: Predictor | None = None,
        max_clock_skew: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        guard: GuardConfig | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        if not max_clock_skew > 0:
            raise ValueError("max_clock_skew must be positive")
        self.max_clock_skew = max_clock_skew
        self._clock = clock
        self.predictor = predictor
        self.predictions = 0
        self.derived = 0
        """Requests whose class came from their ``request`` features."""
        self._cfg = config if config is not None else SaeConfig()
        self._guard = guard
        self._names = tuple(backends)
        self._backends: dict[str, _Backend] = {}
        self.max_blocks = max_blocks

    def cache(self, backend: str) -> SaeCache | None:
        """The backend's state (None before its first event)."""
        b = self._backends.get(backend)
        return None if b is None else b.cache

    def _backend(self, name: str) -> _Backend | None:
        b = self._backends.get(name)
        if b is None and name in self._names:
            b = self._backends[name] = _Backend(self._cfg, self._guard)
        return b

    def stats(self) -> dict[str, dict[str, int]]:
        """Per backend seen so far: ``advisor_clamped_timestamps``, ``advisor_blocks``."""
        return {
            name: {"advisor_clamped_timestamps": b.clamped, "advisor_blocks": len(b.cache)}
            for name, b in self._backends.items()
        }

    def _time(self, b: _Backend, timestamp: float, server: float) -> float:
        """``timestamp`` on the engine's clock, clamped to the skew bound; 0: ``b.now``."""
        if timestamp <= 0:
            return b.now
        if b.offset is None:
            b.offset = timestamp - server
            return timestamp
        expected = server + b.offset
        if abs(timestamp - expected) > self.max_clock_skew:
            b.clamped += 1
            if b.clamped == 1:
                log.warning(
                    "eviction advisor: a timestamp %.0f s off the server clock's estimate;"
                    " clamped (further ones only counted)",
                    timestamp - expected,
                )
            return expected
        return timestamp

    def _unknown(self, name: str) -> str:
        known = ", ".join(self._names) or "none"
        return f'unknown backend "{name}" (configured: {known})'

    # -- Observe --------------------------------------------------------------------------

    async def Observe(
        self,
        request_iterator: AsyncIterator[pb.ObserveRequest],
        context: grpc.aio.ServicerContext,
    ) -> pb.ObserveResponse:
        applied = forgotten = 0
        async for req in request_iterator:
            b = self._backend(req.backend)
            if b is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(req.backend))
            assert b is not None
            try:
                _validate(req.events, self.predictor)
            except _InvalidArgument as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            before = b.forgotten
            self.apply(b, req.events)
            applied += len(req.events)
            forgotten += b.forgotten - before
        return pb.ObserveResponse(events_applied=applied, blocks_forgotten=forgotten)

    def apply(self, b: _Backend, events: Iterable[pb.BlockEvent]) -> None:
        """Apply validated events to one backend's state, then enforce its bound."""
        c = b.cache
        server = self._clock()
        for ev in events:
            now = self._time(b, ev.timestamp, server)
            if now > b.now:
                b.now = now
            kind = ev.kind
            if kind == pb.BLOCK_EVENT_KIND_REQUEST_STARTED:
                c.begin_request(ev.session_id, now, self._session_class(c, ev))
            elif kind == pb.BLOCK_EVENT_KIND_INSERTED:
                c.insert(
                    ev.block_hash,
                    ev.parent_hash or None,
                    ttype=_TYPES.get(ev.token_type, TokenType.USER),
                    offset=ev.offset,
                    now=now,
                    session=ev.session_id,
                )
            elif kind == pb.BLOCK_EVENT_KIND_HIT:
                c.hit(ev.block_hash, now=now, session=ev.session_id)
            elif kind == pb.BLOCK_EVENT_KIND_RELEASED:
                c.release(ev.block_hash)
            else:
                c.remove(ev.block_hash)
        while len(c) > self.max_blocks:
            if c.evict(b.now) is None:
                log.warning(
                    "eviction advisor: %d blocks all in use (over max_blocks %d): reset",
                    len(c),
                    self.max_blocks,
                )
                b.forgotten += len(c)
                c.clear()
                break
            b.forgotten += 1

    def _session_class(self, c: SaeCache, ev: pb.BlockEvent) -> SessionClass:
        """The engine's guess; else the class its ``request`` features point to; else the
        predictor's for a new session with ``features``."""
        guess = _CLASSES.get(ev.session_class, SessionClass.UNKNOWN)
        if guess == SessionClass.UNKNOWN and ev.HasField("request"):
            guess = classify(request_features(ev.request))
            if guess != SessionClass.UNKNOWN:
                self.derived += 1
                return guess
        if (
            guess == SessionClass.UNKNOWN
            and self.predictor is not None
            and ev.features
            and c.session_class(ev.session_id) is None
        ):
            self.predictions += 1
            return self.predictor.classify(ev.features, ev.tools)
        return guess

    # -- RankVictims ----------------------------------------------------------------------

    async def RankVictims(
        self, request: pb.RankVictimsRequest, context: grpc.aio.ServicerContext
    ) -> pb.RankVictimsResponse:
        b = self._backend(request.backend)
        if b is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.backend))
        assert b is not None
        cands = request.candidate_hashes
        if not cands:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "candidate_hashes is empty")
        if len(cands) > MAX_CANDIDATES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(cands)} candidate_hashes: at most {MAX_CANDIDATES} per request",
            )
        if request.n < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "n must be at least 1")
        for i, h in enumerate(cands):
            if not 0 < len(h) <= MAX_HASH_BYTES:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"candidate_hashes[{i}] has {len(h)} bytes: 1 to {MAX_HASH_BYTES} allowed",
                )
        now = self._time(b, request.timestamp, self._clock())
        order = b.cache.rank(cands, request.n, now)
        return pb.RankVictimsResponse(block_hashes=order)  # type: ignore[arg-type]


def request_features(msg: pb.RequestFeatures) -> RequestFeatures:
    """The set fields of a ``RequestFeatures`` message, implausible values dropped."""
    return parse_features({d.name: v for d, v in msg.ListFields()})


def _validate(events: Iterable[pb.BlockEvent], predictor: Predictor | None = None) -> None:
    n = 0
    for i, ev in enumerate(events):
        n += 1
        if n > MAX_EVENTS:
            raise _InvalidArgument(f"more than {MAX_EVENTS} events in one ObserveRequest")
        if ev.kind not in _KINDS:
            raise _InvalidArgument(f"events[{i}]: kind is unspecified or unknown ({ev.kind})")
        if ev.kind != pb.BLOCK_EVENT_KIND_REQUEST_STARTED and not (
            0 < len(ev.block_hash) <= MAX_HASH_BYTES
        ):
            raise _InvalidArgument(
                f"events[{i}]: block_hash has {len(ev.block_hash)} bytes: "
                f"1 to {MAX_HASH_BYTES} allowed"
            )
        if len(ev.parent_hash) > MAX_HASH_BYTES:
            raise _InvalidArgument(f"events[{i}]: parent_hash longer than {MAX_HASH_BYTES} bytes")
        if not math.isfinite(ev.timestamp) or ev.timestamp < 0:
            raise _InvalidArgument(f"events[{i}]: timestamp must be a non-negative number")
        if ev.features and predictor is not None:
            if len(ev.features) != predictor.input_dim:
                raise _InvalidArgument(
                    f"events[{i}]: {len(ev.features)} features; the session predictor "
                    f"takes {predictor.input_dim}"
                )
            if not all(math.isfinite(x) for x in ev.features):
                raise _InvalidArgument(f"events[{i}]: features must be finite numbers")


def add_to_server(advisor: EvictionAdvisor, server: grpc.aio.Server) -> str:
    """Register ``advisor`` on ``server``; returns the service name (for reflection)."""
    pb_grpc.add_EvictionAdvisorServicer_to_server(advisor, server)
    return SERVICE_NAME
