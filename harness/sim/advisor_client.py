"""The simulated engine's side of ``continuum.listener.v1.EvictionAdvisor``.

``python -m harness.sim --eviction-advisor HOST:PORT`` makes the engine evict through a
listener's advisor instead of its own LRU order. The engine's prefix cache evicts
synchronously from the head of its LRU order, and a real engine's scheduler cannot wait
for a network round trip per eviction either, so the advice is applied *ahead* of need:

1. after every prefill the engine queues what happened (request start, hits, inserts,
   releases, removals) and wakes a background task;
2. the task sends the queued events on one long-lived ``Observe`` stream, then asks
   ``RankVictims`` for the order of the ``window`` oldest blocks (the LRU head, the blocks
   LRU would evict next) and moves the first ``window // 4`` it returns to the very front
   of the LRU order, first victim first.

So the next evictions take the advisor's victims; if the advisor is slow or down the
engine simply evicts in LRU order (errors are logged once and retried on the next wake).
Token types: a chat request's blocks are typed from its chat template
(``harness.sim.block_types``: system, user, assistant, tool definitions, tool calls and
results; a block takes the type of its first token), and its ``REQUEST_STARTED`` carries
the request's engine-visible features (tools, turns, tool calls and results, reasoning,
temperature, max_tokens) for the advisor's session class; other requests (Anthropic
messages, completions) are sent as ``USER`` without features. The session is the
request's ``x-session-id`` header or ``user`` field.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from bus._gen.continuum.listener.v1 import eviction_advisor_pb2_grpc as pb_grpc
from listener.saecache.classify import RequestFeatures
from listener.saecache.types import TokenType

__all__ = ["AdvisedEviction"]

_USER = pb.TOKEN_TYPE_USER
_PB_TYPES = {
    TokenType.SYSTEM: pb.TOKEN_TYPE_SYSTEM,
    TokenType.USER: pb.TOKEN_TYPE_USER,
    TokenType.ASSISTANT: pb.TOKEN_TYPE_ASSISTANT,
    TokenType.REASONING: pb.TOKEN_TYPE_REASONING,
    TokenType.TOOL_DEF: pb.TOKEN_TYPE_TOOL_DEFINITION,
    TokenType.TOOL_IO: pb.TOKEN_TYPE_TOOL_IO,
}

log = logging.getLogger("harness.sim.advisor")


def _h(block_hash: Any) -> bytes:
    if isinstance(block_hash, bytes):
        return block_hash
    return int(block_hash).to_bytes(8, "big", signed=False)


class AdvisedEviction:
    """Feeds one engine's cache events to the advisor and reorders its LRU by the advice.

    Args:
        target: the listener's gRPC ``host:port``.
        backend: this engine's backend name in the listener's ``sources``.
        window: LRU-head blocks ranked per wake-up.
    """

    def __init__(self, target: str, backend: str, window: int = 256) -> None:
        self.target, self.backend, self.window = target, backend, window
        self._cache: Any = None
        self._events: list[pb.BlockEvent] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._failed = False
        self.ranked = self.moved = 0
        self._described: tuple[list[int], RequestFeatures] | None = None

    def attach(self, cache: Any) -> None:
        """The engine's ``PrefixCache`` (its LRU order is ``cache._blocks``)."""
        self._cache = cache

    # -- engine side (synchronous, on the request path) ------------------------------------

    def describe(self, types: list[int], features: RequestFeatures) -> None:
        """The next ``prefilled`` request's token types (per prompt token) and features."""
        self._described = (types, features)

    def prefilled(
        self, tokens: Sequence[int], salt: str | None, cached: int, session: str | None
    ) -> None:
        cache = self._cache
        now = time.monotonic()
        sid = session or ""
        hashes = cache.block_hashes(tokens, salt)
        hit_blocks = cached // cache.block_size
        evs = self._events
        described, self._described = self._described, None
        types: list[int] = []
        start = pb.BlockEvent(
            kind=pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id=sid, timestamp=now
        )
        if described is not None:
            types, feats = described
            known = {k: v for k in feats.__slots__ if (v := getattr(feats, k)) is not None}
            start.request.CopyFrom(pb.RequestFeatures(**known))
        evs.append(start)
        bs = cache.block_size
        held = []
        parent = b""
        for i, h in enumerate(hashes):
            if h not in cache:
                break
            hb = _h(h)
            kind = pb.BLOCK_EVENT_KIND_HIT if i < hit_blocks else pb.BLOCK_EVENT_KIND_INSERTED
            evs.append(
                pb.BlockEvent(
                    kind=kind,
                    block_hash=hb,
                    parent_hash=parent,
                    session_id=sid,
                    token_type=_PB_TYPES[types[i * bs]] if i * bs < len(types) else _USER,
                    offset=i,
                    timestamp=now,
                )
            )
            held.append(hb)
            parent = hb
        for hb in reversed(held):
            evs.append(pb.BlockEvent(kind=pb.BLOCK_EVENT_KIND_RELEASED, block_hash=hb))
        self._kick()

    def changed(self, stored: list[Any], removed: list[Any]) -> None:
        for h in removed:
            self._events.append(pb.BlockEvent(kind=pb.BLOCK_EVENT_KIND_REMOVED, block_hash=_h(h)))

    def _kick(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="advisor")
        assert self._wake is not None
        self._wake.set()

    # -- background ------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        self._channel = grpc.aio.insecure_channel(self.target)
        stub = pb_grpc.EvictionAdvisorStub(self._channel)
        outbox: asyncio.Queue[pb.ObserveRequest] = asyncio.Queue()
        observe: Any = None
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                try:
                    if observe is None or observe.done():
                        observe = stub.Observe(_drain(outbox))
                    if self._events:
                        batch, self._events = self._events, []
                        outbox.put_nowait(pb.ObserveRequest(backend=self.backend, events=batch))
                        await asyncio.wait_for(outbox.join(), 5)  # sent before the ranking
                    await self._advise(stub)
                    self._failed = False
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    if not self._failed:
                        log.warning("eviction advisor %s: %r", self.target, exc)
                    self._failed = True
        finally:
            if observe is not None:
                observe.cancel()
            await self._channel.close()

    async def _advise(self, stub: pb_grpc.EvictionAdvisorStub) -> None:
        blocks = self._cache._blocks
        if len(blocks) < self._cache.capacity_blocks // 2:
            return  # far from full: nothing will be evicted soon
        head = []
        for h in blocks:
            head.append(h)
            if len(head) >= self.window:
                break
        if not head:
            return
        by_bytes = {_h(h): h for h in head}
        reply = await stub.RankVictims(
            pb.RankVictimsRequest(
                backend=self.backend,
                candidate_hashes=list(by_bytes),
                n=max(1, len(head) // 4),
                timestamp=time.monotonic(),
            ),
            timeout=5,
        )
        self.ranked += 1
        for hb in reversed(reply.block_hashes):
            h = by_bytes.get(hb)
            if h is not None and h in blocks:
                blocks.move_to_end(h, last=False)
                self.moved += 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def _drain(outbox: asyncio.Queue[pb.ObserveRequest]) -> AsyncIterator[pb.ObserveRequest]:
    while True:
        req = await outbox.get()
        yield req
        outbox.task_done()
