"""The composition root: builds the router's parts, wires them, dispatches requests.

Everything the router is made of is built here, once, and each part gets only the
collaborators it uses:

* the backend pool (health, load), the metrics, the upstream HTTP client;
* the selector (strategies, the CHWBL ring) with, under Tier 4, the KV scorer in front;
* the response cache service (Tiers 2 and 3, with its semantic path);
* the KV runtime (Tier 4: index, event consumers, scorer; with conversation-depth routing
  also the chain index and its cost scorer, fed by the prompt chains that
  ``router.conversation`` renders from each chat request);
* push mode's session registry (the KV consumers open their streams from it,
  ``router.serve``'s bus server registers the listeners' sessions in it);
* the Gemini service and the cache-salt step;
* the forwarder (selection + upstream + relay) and, over it, one dialect per client API
  (``router.dialects``), the status endpoints, the admin API and the gRPC KvIndex
  service.

``Router.handle`` is the whole HTTP surface behind the server seam: a table from
(method, path) to handler. Configuration is swapped as a whole on reload
(``apply_config``); handlers read it once per request through ``lambda: self.config``,
so a request never mixes two configs.
"""

from __future__ import annotations

import logging
from typing import Any

from bus.salt import load_secret

from .admin import AdminApi
from .admin_auth import AdminToken
from .cache import build_cache_store
from .cache.semantic import SemanticCache
from .cache.service import ResponseCacheService
from .config import RouterConfig
from .conversation import ConversationKeys
from .dialects import (
    AnthropicMessages,
    CacheSalter,
    ChatCompletions,
    Completions,
    Embeddings,
    Responses,
)
from .errors import openai_error
from .eventbus.sessions import SessionRegistry
from .forwarder import Forwarder
from .gemini import GeminiService
from .gemini.metrics import GeminiCollector, UsageTotals
from .grpc_kvindex import KvIndexServicer
from .http.types import Handler, Request, Response, StreamResponse
from .kv_runtime import KvRuntime
from .metrics import RouterMetrics
from .pool import BackendPool
from .redis import RedisPools
from .selection import Selector
from .status import StatusApi
from .upstream import UpstreamClient

__all__ = ["Router"]

log = logging.getLogger("continuum.router")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pool = BackendPool(config.backends, config.health_check)
        self.metrics = RouterMetrics(lambda: self.pool)
        self.selector = Selector(
            self.pool, config, lambda decision, _backend: self.metrics.prefix_decision(decision)
        )
        self.client = UpstreamClient(
            config.server.connect_timeout_ms / 1000, config.server.request_timeout_ms / 1000
        )
        self.admin_token = AdminToken.from_config(config.server)
        # One Redis pool for the response cache and the KV index.
        self.redis_pools = RedisPools() if config.response_cache.redis is not None else None
        self.cache = self._build_cache(config) if config.response_cache.enabled else None
        # Tier 4 is built with kv_cache_index.enabled (restart-only) and consulted while
        # prefix_routing.enabled (hot-reloaded): without prefix keys nothing queries it, but
        # its consumers keep it fed, so turning prefix routing on routes on a warm index.
        tier4 = config.kv_cache_index.enabled
        self.event_bus = self._build_event_bus(config, tier4)
        self.kv: KvRuntime | None = None
        salter = None
        self.conversation: ConversationKeys | None = None
        """Renders chat requests into prompt chains (conversation-depth routing)."""
        if tier4:
            self.kv = KvRuntime(
                config,
                self.metrics.kv_decision,
                self.redis_pools,
                self.event_bus,
                on_conversation_decision=self.metrics.kv_conversation_decision,
                on_prediction=self.metrics.kv_prediction,
            )
            self.selector.scorer = self.kv.scorer
            self.metrics.attach_kv(self.kv.metrics_snapshot)
            kvc = config.kv_cache_index
            if kvc.salt_secret_file or kvc.salt_secret_env:
                salter = CacheSalter(load_secret(kvc.salt_secret_file, kvc.salt_secret_env))
            if self.kv.conversation is not None:
                self.selector.conversation = self.kv.conversation
                self.conversation = ConversationKeys.from_specs(
                    kvc.conversation.templates,
                    chunk_bytes=kvc.conversation.chunk_bytes,
                    render_cache_bytes=kvc.conversation.render_cache_bytes,
                )
        self.gemini = self._build_gemini(config)
        forwarder = Forwarder(
            self.selector,
            self.client,
            self.pool,
            self.metrics,
            self.kv if self.conversation is not None else None,
        )
        current = lambda: self.config  # noqa: E731 - read per request: a reload swaps it
        self._chat = chat = ChatCompletions(
            config=current,
            pool=self.pool,
            forwarder=forwarder,
            observe=self.metrics.observe,
            cache=self.cache,
            gemini=self.gemini,
            salter=salter,
            conversation=self.conversation,
        )
        messages = AnthropicMessages(
            config=current, pool=self.pool, forwarder=forwarder, gemini=self.gemini
        )
        embeddings = Embeddings(pool=self.pool, forwarder=forwarder)
        generation: dict[str, Any] = dict(
            config=current,
            pool=self.pool,
            forwarder=forwarder,
            observe=self.metrics.observe,
            cache=self.cache,
            salter=salter,
            conversation=self.conversation,
        )
        self._completions = completions = Completions(**generation)
        self._responses = responses = Responses(**generation)
        status = StatusApi(self.pool, self.metrics)
        self.admin = AdminApi(
            config=current,
            token=self.admin_token,
            pool=self.pool,
            counts=self.selector.counts,
            cache=self.cache,
            kv=self.kv,
            gemini=self.gemini,
            conversation=self.conversation,
        )
        self.kvindex_service = KvIndexServicer(
            self.kv,
            self.pool,
            lambda: self.config.prefix_routing.max_prefix_length,
            self.admin_token,
            chain_of=self.conversation.chain if self.conversation is not None else None,
            mtls=config.server.grpc_tls_client_ca is not None,
        )
        """``continuum.kvindex.v1.KvIndex``, served by ``router.serve`` on ``grpc_listen``."""
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): chat.handle,
            ("POST", "/anthropic/v1/messages"): messages.handle,
            ("POST", "/v1/embeddings"): embeddings.handle,
            ("POST", "/v1/completions"): completions.handle,
            ("POST", "/v1/responses"): responses.handle,
            ("GET", "/v1/models"): status.list_models,
            ("GET", "/health"): status.health,
            ("GET", "/metrics"): status.metrics,
            **self.admin.routes(),
        }
        self._paths = frozenset(path for _, path in self._routes)

    def _build_cache(self, config: RouterConfig) -> ResponseCacheService:
        rc = config.response_cache
        store = build_cache_store(
            rc.backend,
            rc.capacity,
            rc.ttl_seconds,
            rc.redis,
            self.redis_pools,
            **self.metrics.cache_store_hooks(),
        )
        cache = ResponseCacheService(rc, store, self.metrics.cache_result)
        cache.policy = config.control_plane.optimization
        cache.semantic = SemanticCache(store, self.pool, self.client, rc.semantic.max_entries)
        return cache

    @staticmethod
    def _build_event_bus(config: RouterConfig, tier4: bool) -> SessionRegistry | None:
        """One session registry per process, None without ``dynamo.event_bus``.

        Without Tier 4 there are no KV consumers: sessions are accepted, nothing is
        subscribed.
        """
        bus = config.dynamo.event_bus
        if not bus.enabled:
            return None
        return SessionRegistry.from_config(bus, Router._bus_sources(config, tier4))

    @staticmethod
    def _bus_sources(config: RouterConfig, tier4: bool) -> list[str]:
        """The backends whose KV events come over the event bus."""
        return [
            s.backend_name
            for s in config.kv_cache_index.event_sources
            if tier4 and s.transport == "event_bus"
        ]

    def _build_gemini(self, config: RouterConfig) -> GeminiService | None:
        gcc = config.gemini_context_cache
        if not (gcc.enabled or gcc.prefer_native_api):
            return None
        usage = UsageTotals()
        gemini = GeminiService(gcc, self.client, usage.add)
        self.metrics.registry.register(GeminiCollector(lambda: gemini.cache, usage))
        return gemini

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.client.start()
        await self.pool.start(self.client)
        if self.kv is not None:
            await self.kv.start()

    async def stop(self) -> None:
        if self.kv is not None:
            await self.kv.stop()
        if self.cache is not None:
            await self.cache.close()
        if self.gemini is not None:
            await self.gemini.close()
        await self.pool.stop()
        await self.client.close()
        if self.redis_pools is not None:
            await self.redis_pools.aclose()

    def apply_config(self, config: RouterConfig) -> None:
        """Apply a validated reload (restart-only sections already kept by the caller)."""
        self.pool.update(config.backends, config.health_check)
        self.selector.configure(config)
        if self.cache is None and config.response_cache.enabled:
            # Off at start, on now: built here on the running store backend and pool
            # (both restart-only); building does no I/O.
            self.cache = self._build_cache(config)
            self._chat.cache = self.admin.cache = self.cache
            self._completions.cache = self._responses.cache = self.cache
            log.info("response cache: built on reload (%s)", config.response_cache.backend)
        elif self.cache is not None:
            self.cache.config = config.response_cache  # ttl, sizes, enabled: per request
            self.cache.policy = config.control_plane.optimization
            if self.cache.semantic is not None:
                self.cache.semantic.index.resize(config.response_cache.semantic.max_entries)
            resize = getattr(self.cache.store, "resize", None)
            if resize is not None:
                resize(config.response_cache.capacity)
        if self.kv is not None:
            self.kv.reconfigure(config.kv_cache_index.event_sources)
        if self.event_bus is not None:
            self.event_bus.update_sources(self._bus_sources(config, self.kv is not None))
        self.config = config

    # -- dispatch ------------------------------------------------------------------

    async def handle(self, req: Request) -> Response | StreamResponse:
        # Every /admin path, known or not, is behind the token: checked once, here.
        if req.path.startswith("/admin/"):
            denied = self.admin.authorize(req)
            if denied is not None:
                return denied
        handler = self._routes.get((req.method, req.path))
        if handler is None:
            if req.path in self._paths:
                return openai_error(405, f"method {req.method} not allowed on {req.path}")
            return openai_error(404, f"no route for {req.method} {req.path}", code="not_found")
        try:
            return await handler(req)
        except Exception:
            log.exception("handler for %s %s failed", req.method, req.path)
            return openai_error(500, "internal router error", "server_error")
