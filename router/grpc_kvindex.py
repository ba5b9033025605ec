"""``continuum.kvindex.v1.KvIndex``: the router's KV index state for operators' tools.

Runs on the router's own gRPC server (``server.grpc_listen``) beside health and
reflection, so ``grpcurl`` can list and call it. Read RPCs never change the index, its
LRU order or the routing counters (Score computes what the router *would* decide).

Every method, reads included (they disclose which backend holds which prompt prefix), is
behind the admin token as call credentials (``authorization: Bearer <token>`` metadata)
when one is configured, or behind mTLS (``server.grpc_tls_client_ca``: the handshake
already verified the client's certificate, so a call is authenticated as it arrives).
Without either the port is open, which validation allows only on loopback or with
``server.allow_unauthenticated``. Health and reflection stay open, for probes.

Collaborators, each what it reads: Tier 4 (``KvRuntime``, None when the index is off:
every call then answers FAILED_PRECONDITION), the backend pool (Score's candidates), the
running ``prefix_routing.max_prefix_length`` (Score of a request), the admin token, and
the request -> prompt chain computation of conversation routing (``chain_of(body, model)``,
None when a request cannot be rendered; the servicer gets None for the whole callable when
conversation routing is off). The chain index and the conversation scorer come from
``KvRuntime`` (``chain_index``, ``conversation``); a chain key or chain without them is
FAILED_PRECONDITION.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import orjson

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.grpc_server import abort
from bus.prefix_key import extract_prefix_key

from .admin_auth import AdminToken
from .kv_runtime import KvRuntime
from .kvindex.base import IndexEntry, StorageTier
from .kvindex.cost import ConversationScorer, RequestChain
from .kvindex.scorer import Prepared
from .pool import ENDPOINT_TYPES, Backend, BackendPool

__all__ = ["SERVICE_NAME", "ChainOf", "KvIndexServicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvIndex"].full_name
_HEX64 = re.compile(r"[0-9a-fA-F]{64}\Z")
_HEX32 = re.compile(r"[0-9a-fA-F]{32}\Z")

ChainOf = Callable[[dict[str, Any], str], "RequestChain | None"]
"""``(body, model) -> RequestChain | None``: the router's rendering of a request into its
prompt chain (``router.conversation.ConversationKeys.chain``; None: no template for the
model, or the request does not render)."""


@dataclass(frozen=True, slots=True)
class _GivenChain:
    """A ``PromptChain`` from the wire, as the scorer reads a chain (no conversation:
    ``Score`` reads costs, it routes nothing)."""

    keys: Sequence[bytes]
    prompt_bytes: int
    conversation: bytes | None = None


_TIERS: dict[StorageTier | None, Any] = {
    StorageTier.GPU_HOT: pb.TIER_GPU_HOT,
    StorageTier.STORAGE_WARM: pb.TIER_STORAGE_WARM,
}


def _unix_ms(t: Any) -> int:
    """A wall-clock ms value from an index expiry (monotonic or wall seconds)."""
    if t is None:
        return 0
    now_mono = time.monotonic()
    if t < 1e9:  # monotonic clock: convert through now
        return int((time.time() + (t - now_mono)) * 1000)
    return int(t * 1000)


class KvIndexServicer(pb_grpc.KvIndexServicer):
    def __init__(
        self,
        kv: KvRuntime | None,
        pool: BackendPool,
        max_prefix_length: Callable[[], int],
        token: AdminToken,
        chain_of: ChainOf | None = None,
        *,
        mtls: bool = False,
    ) -> None:
        self._kv = kv
        self._pool = pool
        self._max_prefix_length = max_prefix_length
        self._token = token
        self._chain_of = chain_of
        self._mtls = mtls
        """Clients present a verified certificate: that is the authentication."""

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self._mtls or not self._token.required:
            return
        meta = dict(context.invocation_metadata() or ())
        if not self._token.allows(str(meta.get("authorization", ""))):
            await abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "KvIndex needs the admin token: metadata 'authorization: Bearer <token>'",
            )

    async def _require_kv(self, context: grpc.aio.ServicerContext) -> KvRuntime:
        kv = self._kv
        if kv is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "the KV cache index is not enabled (kv_cache_index.enabled and "
                "prefix_routing.enabled)",
            )
        return kv

    @staticmethod
    async def _require_conversation(
        kv: KvRuntime, context: grpc.aio.ServicerContext
    ) -> ConversationScorer:
        scorer = kv.conversation
        if scorer is None:
            await abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "conversation routing is not enabled (kv_cache_index.conversation.enabled)",
            )
        return scorer

    @staticmethod
    async def _prefix(value: str, context: grpc.aio.ServicerContext) -> str:
        if not _HEX64.match(value):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "prefix_hash must be 64 hex characters (a SHA-256 prefix key)",
            )
        return value.lower()

    @staticmethod
    async def _chain_key(value: str, field: str, context: grpc.aio.ServicerContext) -> bytes:
        if not _HEX32.match(value):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{field} must be 32 hex characters (a prompt chain key)",
            )
        return bytes.fromhex(value)

    @staticmethod
    def _entries(entries: Sequence[IndexEntry]) -> list[pb.IndexEntry]:
        return [
            pb.IndexEntry(
                backend=e.backend,
                token_count=e.token_count,
                tier=_TIERS.get(e.tier, pb.TIER_UNSPECIFIED),
                expires_at_unix_ms=_unix_ms(e.expires_at),
            )
            for e in entries
        ]

    async def Query(self, request: pb.QueryRequest, context: Any) -> pb.QueryResponse:
        await self._authorize(context)
        kv = await self._require_kv(context)
        if request.chain_key:
            if request.prefix_hash:
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "set prefix_hash or chain_key, not both",
                )
            await self._require_conversation(kv, context)
            key = await self._chain_key(request.chain_key, "chain_key", context)
            assert kv.chain_index is not None
            found = await kv.chain_index.peek(key)
            return pb.QueryResponse(chain_key=key.hex(), entries=self._entries(found))
        prefix = await self._prefix(request.prefix_hash, context)
        entries = await kv.index.peek(prefix)
        return pb.QueryResponse(prefix_hash=prefix, entries=self._entries(entries))

    async def Score(self, request: pb.ScoreRequest, context: Any) -> pb.ScoreResponse:
        await self._authorize(context)
        kv = await self._require_kv(context)
        which = request.WhichOneof("key")
        model: str | None = None
        chain: RequestChain | None = None
        if which == "chain":
            conv = await self._require_conversation(kv, context)
            keys = [
                await self._chain_key(k, f"chain.keys[{i}]", context)
                for i, k in enumerate(request.chain.keys)
            ]
            size = max(request.chain.prompt_bytes, len(keys) * conv.chunk_bytes)
            conversation = await self._score_chain(
                conv, _GivenChain(keys, size), self._chat_candidates()
            )
            return pb.ScoreResponse(threshold=kv.scorer.threshold, conversation=conversation)
        if which == "prefix_hash":
            prefix = await self._prefix(request.prefix_hash, context)
        elif which == "request":
            try:
                body = orjson.loads(request.request.request_json)
            except orjson.JSONDecodeError as exc:
                await abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, f"request_json is not JSON: {exc}"
                )
            if not isinstance(body, dict):
                await abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "request_json must be a JSON object"
                )
            model = request.request.model or body.get("model")
            if not isinstance(model, str) or not model:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a model is required")
            key = extract_prefix_key(
                body,
                model=model,
                max_prefix_length=self._max_prefix_length(),
            )
            if key is None:
                await abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, "the request has no text to key on"
                )
            prefix = key.hex()
            if kv.conversation is not None and self._chain_of is not None:
                chain = self._chain_of(body, model)
        else:
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, "set prefix_hash, request or chain"
            )
        if model is not None:
            candidates, _ = self._pool.candidates(model, "chat")
        else:  # every backend a chat request could be routed to
            candidates = self._chat_candidates()
        scorer = kv.scorer
        entries = {e.backend: e for e in await kv.index.peek(prefix)}
        snapshot = Prepared.build(0.0, entries, candidates)
        scores = []
        best, best_score = "", 0.0
        for b in candidates:
            entry = entries.get(b.name)
            if entry is None:
                continue  # only holders are scored
            final, overlap, idle, health, tier = scorer.components(snapshot, b)
            scores.append(
                pb.BackendScore(
                    backend=b.name,
                    overlap=overlap if final > 0.0 else 0.0,
                    load=1.0 - idle,
                    health=health,
                    final_score=final,
                    tier=_TIERS.get(tier, pb.TIER_UNSPECIFIED),
                    token_count=entry.token_count,
                )
            )
            if final > best_score:
                best, best_score = b.name, final
        scores.sort(key=lambda s: (-s.final_score, s.backend))
        reply = pb.ScoreResponse(
            prefix_hash=prefix,
            scores=scores,
            selected_backend=best if best_score > scorer.threshold else "",
            threshold=scorer.threshold,
        )
        if chain is not None and kv.conversation is not None:
            reply.conversation.CopyFrom(await self._score_chain(kv.conversation, chain, candidates))
        return reply

    def _chat_candidates(self) -> tuple[Backend, ...]:
        """Every backend a chat request could be routed to (Score without a model)."""
        types = ENDPOINT_TYPES["chat"]
        return tuple(
            b
            for b in self._pool.backends
            if b.healthy and b.config.enabled and not b.config.internal and b.type in types
        )

    @staticmethod
    async def _score_chain(
        scorer: ConversationScorer, chain: RequestChain, candidates: Sequence[Backend]
    ) -> pb.ConversationScore:
        """The conversation cost model for ``chain``, read-only: an uncounted index read,
        no decision recorded, nothing predicted."""
        view = await scorer.assess(chain, candidates, peek=True)
        best, outcome = scorer.pick(view, candidates)
        scores = []
        for b in candidates:
            c = scorer.components(view, b)
            scores.append(
                pb.BackendScore(
                    backend=b.name,
                    tier=_TIERS.get(c.tier, pb.TIER_UNSPECIFIED),
                    held_tokens=c.held_tokens,
                    chain_depth=c.depth,
                    cost=c.cost,
                    in_flight_prefill_tokens=c.in_flight_prefill_tokens,
                    in_flight_requests=c.in_flight_requests,
                )
            )
        scores.sort(key=lambda s: (s.cost, s.backend))
        return pb.ConversationScore(
            chain_length=len(chain.keys),
            prompt_bytes=view.prompt_bytes,
            prompt_tokens=view.prompt_tokens,
            scores=scores,
            selected_backend=best.name if best is not None else "",
            outcome=outcome,
        )

    async def Backends(self, request: pb.BackendsRequest, context: Any) -> pb.BackendsResponse:
        await self._authorize(context)
        kv = await self._require_kv(context)
        out = []
        transports = {s.backend_name: s.transport for s in kv.config.event_sources}
        counts = await kv.index.backend_counts()
        chain_counts = await kv.chain_index.backend_counts() if kv.chain_index is not None else {}
        for name, c in kv.consumer_stats().items():
            last = c.get("last_event_at")
            out.append(
                pb.BackendStatus(
                    name=name,
                    transport=transports.get(name, "sse"),
                    connected=bool(c.get("connected")),
                    events_received=c.get("received", 0),
                    events_processed=c.get("processed", 0),
                    events_dropped=c.get("dropped", 0),
                    index_created=c.get("index_created", 0),
                    index_evicted=c.get("index_evicted", 0),
                    reconnects=c.get("reconnects", 0),
                    last_event_at_unix_ms=int(last.timestamp() * 1000) if last is not None else 0,
                    last_event_id=c.get("last_event_id") or "",
                    entries=counts.get(name, 0),
                    chain_entries=chain_counts.get(name, 0),
                )
            )
        return pb.BackendsResponse(backends=out)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        await self._authorize(context)
        kv = await self._require_kv(context)
        st = await kv.index.stats()
        counts = await kv.index.backend_counts()
        reply = pb.StatsResponse(
            backend_counts=[
                pb.BackendCount(backend=name, entries=n) for name, n in sorted(counts.items())
            ],
            total_entries=st.entry_count,
            prefix_count=st.prefix_count,
            index_backend=kv.config.backend,
            fallback_active=st.fallback_active,
            queries=kv.queries,
            hits=st.total_hits,
            evictions=st.total_evictions,
        )
        chains, scorer = kv.chain_index, kv.conversation
        if chains is not None and scorer is not None:
            cst = await chains.stats()
            chain_counts = await chains.backend_counts()
            reply.chain.CopyFrom(
                pb.ChainIndexStats(
                    total_entries=cst.entry_count,
                    key_count=cst.prefix_count,
                    backend_counts=[
                        pb.BackendCount(backend=name, entries=n)
                        for name, n in sorted(chain_counts.items())
                    ],
                    fallback_active=cst.fallback_active,
                    queries=chains.queries,
                    hits=cst.total_hits,
                    evictions=cst.total_evictions,
                    predicted_keys=scorer.predicted_keys,
                )
            )
        return reply

    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        await self._authorize(context)
        kv = await self._require_kv(context)
        chains = kv.chain_index
        chain_removed = 0
        if request.backend:  # an unknown name simply removes nothing
            removed = await kv.index.remove_backend(request.backend)
            if chains is not None:
                chain_removed = await chains.remove_backend(request.backend)
        else:
            removed = await kv.index.clear()
            if chains is not None:
                chain_removed = await chains.clear()
        return pb.ClearResponse(removed=removed, chain_removed=chain_removed)
