"""gRPC ``continuum.listener.v1.Listener`` (grpc.aio), with gRPC health and reflection.

``Subscribe`` reads the same ``EventHub`` as ``GET /events/{backend}``, so both carry the
same records with the same ids and the same resync rules; the per-RPC contract is in
``proto/continuum/listener/v1/listener.proto``. TLS is used when ``grpc_tls`` is set
(with client certificates required when ``grpc_tls.client_ca`` is).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health

from bus import grpc_tls
from bus._gen.continuum.listener.v1 import listener_pb2, listener_pb2_grpc
from bus.errors import BUFFER_OVERFLOW
from bus.grpc_server import generated, start_server

from .config import GrpcTlsConfig, SourceConfig
from .sse_server import numeric_leaves
from .stream import EventHub, StatsProvider, Subscription

__all__ = ["SERVICE_NAME", "GrpcServer", "ListenerServicer", "server_credentials"]

log = logging.getLogger("continuum.listener.grpc")

SERVICE_NAME: str = listener_pb2.DESCRIPTOR.services_by_name["Listener"].full_name
_ENGINES = {
    "vllm": listener_pb2.ENGINE_VLLM,
    "sglang": listener_pb2.ENGINE_SGLANG,
    "trtllm": listener_pb2.ENGINE_TRTLLM,
}


def _endpoints(source: SourceConfig) -> list[str]:
    if source.engine == "trtllm":
        return [source.trtllm_endpoint] if source.trtllm_endpoint else []
    if source.zmq_endpoint is None:
        return []
    return [ep.endpoint for ep in source.zmq_endpoints()]


class ListenerServicer(listener_pb2_grpc.ListenerServicer):
    """The Listener service over one hub.

    Args:
        hub: Where Subscribe reads from; its backends are the valid names.
        sources: The configured sources, for the Sources RPC.
        stats_provider: Per-source counters (backend -> dict) for the Stats RPC.
        batch_limit: Most records taken from the hub per wake-up.
    """

    def __init__(
        self,
        hub: EventHub,
        sources: Sequence[SourceConfig] = (),
        stats_provider: StatsProvider | None = None,
        batch_limit: int = 256,
    ) -> None:
        self.hub = hub
        self._sources = list(sources)
        self._stats = stats_provider
        self._batch_limit = batch_limit
        self._subs: set[Subscription] = set()

    def _unknown(self, backend: str) -> str:
        known = ", ".join(self.hub.backends) or "none"
        return f'unknown backend "{backend}" (configured: {known})'

    def close_streams(self) -> None:
        """End every open Subscribe call with UNAVAILABLE (shutdown). Idempotent."""
        for sub in list(self._subs):
            sub.close("shutdown")

    async def Sources(
        self, request: listener_pb2.SourcesRequest, context: grpc.aio.ServicerContext
    ) -> listener_pb2.SourcesResponse:
        out = listener_pb2.SourcesResponse(epoch=self.hub.epoch)
        for s in self._sources:
            out.sources.append(
                listener_pb2.Source(
                    backend_name=s.backend_name,
                    engine=_ENGINES[s.engine],
                    endpoints=_endpoints(s),
                    model=s.model or "",
                    last_event_id=(
                        self.hub.last_event_id(s.backend_name) if s.backend_name in self.hub else ""
                    ),
                )
            )
        return out

    async def Stats(
        self, request: listener_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> listener_pb2.StatsResponse:
        if request.backend and request.backend not in self.hub:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(request.backend))
        hub_stats = self.hub.stats()
        source_stats: dict[str, Any] = {}
        if self._stats is not None:
            try:
                source_stats = self._stats()
            except Exception as exc:
                log.exception("stats provider failed")
                await context.abort(grpc.StatusCode.INTERNAL, f"stats provider failed: {exc}")
        out = listener_pb2.StatsResponse(epoch=self.hub.epoch)
        for name, st in hub_stats["backends"].items():
            if request.backend and name != request.backend:
                continue
            counters = dict(numeric_leaves("", source_stats.get(name) or {}))
            out.backends.append(
                listener_pb2.BackendStats(
                    backend=name,
                    seq=st["seq"],
                    last_event_id=st["last_event_id"],
                    history_records=st["history"],
                    oldest_seq=st["oldest_seq"] or 0,
                    subscribers=st["subscribers"],
                    events_published=st["published"],
                    resyncs_published=st["resyncs_published"],
                    resync_blocks=st["resync_blocks"],
                    overflows=st["overflows"],
                    source_counters=counters,
                )
            )
        return out

    async def Subscribe(
        self, request: listener_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[listener_pb2.SubscribeResponse]:
        backend = request.backend
        if backend not in self.hub:
            await context.abort(grpc.StatusCode.NOT_FOUND, self._unknown(backend))
        sub = self.hub.subscribe(backend, request.last_event_id or None)
        self._subs.add(sub)
        try:
            while True:
                batch = await sub.batch(self._batch_limit)
                if not batch:
                    break
                for r in batch:
                    yield listener_pb2.SubscribeResponse(id=r.id, event=r.event, json=r.data)
            reason = sub.close_reason
        finally:
            sub.close()
            self._subs.discard(sub)
        if reason == BUFFER_OVERFLOW:
            log.warning("closed a slow gRPC subscriber of %s: buffer_overflow", backend)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"buffer_overflow: subscriber queue full ({self.hub.queue_size} events); "
                "resume from the last event id",
            )
        elif reason == "shutdown":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "listener shutting down")


def server_credentials(tls: GrpcTlsConfig) -> grpc.ServerCredentials:
    """Server TLS credentials from PEM files; client certificates required with client_ca."""
    return grpc_tls.server_credentials(tls.cert, tls.key, tls.client_ca)


class GrpcServer:
    """A grpc.aio server with Listener, health (``""`` and the Listener service) and
    reflection. ``start`` may be called once; ``stop`` is idempotent."""

    def __init__(
        self,
        servicer: ListenerServicer,
        tls: GrpcTlsConfig | None = None,
        extra: Sequence[Callable[[grpc.aio.Server], str]] = (),
    ) -> None:
        """``extra``: registrars of further services (each returns its service name)."""
        self.servicer = servicer
        self._extra = tuple(extra)
        self._tls = tls
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.port: int | None = None

    async def start(self, listen: str) -> int:
        """Bind ``host:port`` and serve; returns the bound port (0 = any free port).

        Raises:
            RuntimeError: the address could not be bound.
            OSError: a TLS file could not be read.
        """
        started = await start_server(
            listen,
            [
                generated(
                    listener_pb2_grpc.add_ListenerServicer_to_server, self.servicer, SERVICE_NAME
                ),
                *self._extra,
            ],
            credentials=server_credentials(self._tls) if self._tls is not None else None,
            health_status={"": True, SERVICE_NAME: True},
            reflection=True,
        )
        self._server, self._health, self.port = started.server, started.health, started.port
        return started.port

    async def stop(self, grace: float = 2.0) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        self.servicer.close_streams()
        await server.stop(grace)
