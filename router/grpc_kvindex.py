"""``continuum.kvindex.v1.KvIndex``: the router's KV index state for operators' tools.

Runs on the router's own gRPC server (``server.grpc_listen``) beside health and
reflection, so ``grpcurl`` can list and call it. Read RPCs never change the index, its
LRU order or the routing counters (Score computes what the router *would* decide).
``Clear`` changes state, so it needs the admin token as call credentials
(``authorization: Bearer <token>`` metadata) when one is configured.

Collaborators, each what it reads: Tier 4 (``KvRuntime``, None when the index is off:
every call then answers FAILED_PRECONDITION), the backend pool (Score's candidates), the
running ``prefix_routing.max_prefix_length`` (Score of a request) and the admin token.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import grpc
import orjson

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.grpc_server import abort
from bus.prefix_key import extract_prefix_key

from .admin_auth import AdminToken
from .kv_runtime import KvRuntime
from .kvindex.base import StorageTier
from .kvindex.scorer import Prepared
from .pool import ENDPOINT_TYPES, BackendPool

__all__ = ["SERVICE_NAME", "KvIndexServicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvIndex"].full_name
_HEX64 = re.compile(r"[0-9a-fA-F]{64}\Z")
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
    ) -> None:
        self._kv = kv
        self._pool = pool
        self._max_prefix_length = max_prefix_length
        self._token = token

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
    async def _prefix(value: str, context: grpc.aio.ServicerContext) -> str:
        if not _HEX64.match(value):
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "prefix_hash must be 64 hex characters (a SHA-256 prefix key)",
            )
        return value.lower()

    async def Query(self, request: pb.QueryRequest, context: Any) -> pb.QueryResponse:
        kv = await self._require_kv(context)
        prefix = await self._prefix(request.prefix_hash, context)
        entries = await kv.index.peek(prefix)
        return pb.QueryResponse(
            prefix_hash=prefix,
            entries=[
                pb.IndexEntry(
                    backend=e.backend,
                    token_count=e.token_count,
                    tier=_TIERS.get(e.tier, pb.TIER_UNSPECIFIED),
                    expires_at_unix_ms=_unix_ms(e.expires_at),
                )
                for e in entries
            ],
        )

    async def Score(self, request: pb.ScoreRequest, context: Any) -> pb.ScoreResponse:
        kv = await self._require_kv(context)
        which = request.WhichOneof("key")
        model: str | None = None
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
        else:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "set prefix_hash or request")
        if model is not None:
            candidates, _ = self._pool.candidates(model, "chat")
        else:  # every backend a chat request could be routed to
            types = ENDPOINT_TYPES["chat"]
            candidates = tuple(
                b
                for b in self._pool.backends
                if b.healthy and b.config.enabled and not b.config.internal and b.type in types
            )
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
        return pb.ScoreResponse(
            prefix_hash=prefix,
            scores=scores,
            selected_backend=best if best_score > scorer.threshold else "",
            threshold=scorer.threshold,
        )

    async def Backends(self, request: pb.BackendsRequest, context: Any) -> pb.BackendsResponse:
        kv = await self._require_kv(context)
        out = []
        transports = {s.backend_name: s.transport for s in kv.config.event_sources}
        counts = await kv.index.backend_counts()
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
                )
            )
        return pb.BackendsResponse(backends=out)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        kv = await self._require_kv(context)
        st = await kv.index.stats()
        counts = await kv.index.backend_counts()
        return pb.StatsResponse(
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

    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        if self._token.required:
            meta = dict(context.invocation_metadata() or ())
            if not self._token.allows(str(meta.get("authorization", ""))):
                await abort(
                    context,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "Clear needs the admin token: metadata 'authorization: Bearer <token>'",
                )
        kv = await self._require_kv(context)
        if request.backend:  # an unknown name simply removes nothing
            removed = await kv.index.remove_backend(request.backend)
        else:
            removed = await kv.index.clear()
        return pb.ClearResponse(removed=removed)
