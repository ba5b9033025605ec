"""The router: request handlers wired to the pool, the selector and the proxy.

``Router.handle`` is the whole HTTP surface behind the server seam. Configuration is
swapped as a whole on reload (``apply_config``); a handler reads ``self.config`` once
per request, so a request never mixes two configs.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson

from bus.prefix_key import extract_prefix_key

from .admin import gemini_context_cache_stats, prefix_routing_stats
from .anthropic_cache import inject_cache_control, should_inject
from .cache.response import replay_sse
from .cache.semantic import SemanticCache
from .cache.service import CacheLookup, ResponseCacheService
from .config import RouterConfig
from .errors import anthropic_error, openai_error
from .http.types import Request, Response, StreamResponse
from .metrics import CONTENT_TYPE, RouterMetrics
from .pool import Backend, BackendPool, Endpoint
from .proxy import ForwardSpec, forward
from .selection import SelectionContext, Selector
from .upstream import UpstreamClient

if TYPE_CHECKING:
    from .eventbus.hub import EventBusHub
    from .gemini import GeminiService
    from .kv_runtime import KvRuntime

__all__ = ["Router"]

log = logging.getLogger("continuum.router")

_JSON_HEADERS = [("content-type", "application/json")]
_ANTHROPIC_VERSION = "2023-06-01"
_GEMINI_OPENAI_PREFIX = "/v1beta/openai"
_NOT_FORWARDED = frozenset(
    (
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "authorization",
        "x-api-key",
        "x-goog-api-key",
        "accept-encoding",
        "content-type",
        "expect",
    )
)


def _chat_path(b: Backend) -> str:
    return (
        _GEMINI_OPENAI_PREFIX + "/chat/completions"
        if b.type == "gemini"
        else "/v1/chat/completions"
    )


def _embeddings_path(b: Backend) -> str:
    return _GEMINI_OPENAI_PREFIX + "/embeddings" if b.type == "gemini" else "/v1/embeddings"


def _messages_path(b: Backend) -> str:
    return "/v1/messages"


def _read_admin_token(cfg: RouterConfig) -> bytes | None:
    if cfg.server.admin_token_file:
        token = Path(cfg.server.admin_token_file).read_text(encoding="utf-8").strip()
        return token.encode() if token else None
    if cfg.server.admin_token_env:
        token = os.environ.get(cfg.server.admin_token_env, "").strip()
        return token.encode() if token else None
    return None


class Router:
    def __init__(self, config: RouterConfig, event_bus: EventBusHub | None = None) -> None:
        self.config = config
        self.pool = BackendPool(config.backends, config.health_check)
        self.metrics = RouterMetrics(lambda: self.pool)
        self.selector = Selector(
            self.pool, config, lambda decision, _backend: self.metrics.prefix_decision(decision)
        )
        self.client = UpstreamClient(
            config.server.connect_timeout_ms / 1000, config.server.request_timeout_ms / 1000
        )
        self.admin_token = _read_admin_token(config)
        self.redis_pools: Any = None
        if config.response_cache.redis is not None:
            from .redis import RedisPools  # one pool: response cache + KV index

            self.redis_pools = RedisPools()
        self.cache: ResponseCacheService | None = None
        if config.response_cache.enabled:
            self.cache = _build_response_cache(config, self.redis_pools, self.metrics)
            self.cache.policy = config.control_plane.optimization
            self.cache.semantic = SemanticCache(
                self.cache.store, self.pool, self.client, config.response_cache.semantic.max_entries
            )
        self.kv: KvRuntime | None = None
        if config.prefix_routing.enabled and config.kv_cache_index.enabled:
            from .kv_runtime import KvRuntime  # Tier 4 only costs when configured

            self.kv = KvRuntime(config, self.metrics.kv_decision, self.redis_pools, event_bus)
            self.selector.scorer = self.kv.scorer
            self.metrics.attach_kv(self.kv.metrics_snapshot)
        self.gemini: GeminiService | None = None
        gcc = config.gemini_context_cache
        if gcc.enabled or gcc.prefer_native_api:
            from .gemini import GeminiService  # only costs when configured
            from .gemini.metrics import GeminiCollector, UsageTotals

            usage = UsageTotals()
            self.gemini = GeminiService(gcc, self.client, usage.add)
            gemini = self.gemini
            self.metrics.registry.register(GeminiCollector(lambda: gemini.cache, usage))
        self._routes = {
            ("POST", "/v1/chat/completions"): self.chat_completions,
            ("POST", "/anthropic/v1/messages"): self.anthropic_messages,
            ("POST", "/v1/embeddings"): self.embeddings,
            ("GET", "/v1/models"): self.list_models,
            ("GET", "/health"): self.health,
            ("GET", "/metrics"): self.render_metrics,
            ("GET", "/admin/prefix-routing/stats"): self.admin_prefix_stats,
            ("GET", "/admin/kv-index/stats"): self.admin_kv_stats,
            ("GET", "/admin/kv-index/backends"): self.admin_kv_backends,
            ("POST", "/admin/kv-index/clear"): self.admin_kv_clear,
            ("GET", "/admin/response-cache/stats"): self.admin_cache_stats,
            ("POST", "/admin/response-cache/invalidate"): self.admin_cache_invalidate,
            ("GET", "/admin/gemini-context-cache/stats"): self.admin_gemini_stats,
            ("POST", "/admin/gemini-context-cache/clear"): self.admin_gemini_clear,
        }

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

    def apply_config(self, config: RouterConfig) -> None:
        """Apply a validated reload (restart-only sections already kept by the caller)."""
        self.pool.update(config.backends, config.health_check)
        self.selector.configure(config)
        if self.cache is not None:
            self.cache.config = config.response_cache  # ttl, sizes, enabled: per request
            self.cache.policy = config.control_plane.optimization
            if self.cache.semantic is not None:
                self.cache.semantic.index.resize(config.response_cache.semantic.max_entries)
            resize = getattr(self.cache.store, "resize", None)
            if resize is not None:
                resize(config.response_cache.capacity)
        self.config = config

    # -- dispatch ------------------------------------------------------------------

    async def handle(self, req: Request) -> Response | StreamResponse:
        # Every /admin path, known or not, is behind the token: checked once, here.
        if req.path.startswith("/admin/") and not self._admin_ok(req):
            return self._unauthorized()
        handler = self._routes.get((req.method, req.path))
        if handler is None:
            if any(path == req.path for _, path in self._routes):
                return openai_error(405, f"method {req.method} not allowed on {req.path}")
            return openai_error(404, f"no route for {req.method} {req.path}", code="not_found")
        try:
            return await handler(req)
        except Exception:
            log.exception("handler for %s %s failed", req.method, req.path)
            return openai_error(500, "internal router error", "server_error")

    # -- OpenAI-compatible ---------------------------------------------------------

    @staticmethod
    def _parse(req: Request, err: Any) -> dict[str, Any] | Response:
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as exc:
            return err(400, f"request body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(body, dict):
            return err(400, "request body must be a JSON object", "invalid_json")
        return body

    def _no_candidates(self, model: str, endpoint: Endpoint, err: Any) -> Response:
        if self.pool.knows_model(model, endpoint):
            return err(503, f"no healthy backend is available for model '{model}'", "no_backend")
        return err(404, f"the model '{model}' is not served by any backend", "model_not_found")

    @staticmethod
    def _forwarded(req: Request) -> dict[str, str]:
        """The client's end-to-end headers (tracing, request ids, vendor extensions).

        Hop-by-hop headers, the client's credentials (the router authenticates to the
        backend with the backend's own key) and the headers the router sets are dropped.
        """
        return {k: v for k, v in req.headers.items() if k not in _NOT_FORWARDED}

    def _upstream_headers(self, b: Backend, req: Request) -> dict[str, str]:
        h = self._forwarded(req)
        h["content-type"] = "application/json"
        h["accept-encoding"] = "identity"
        if b.api_key:
            h["authorization"] = f"Bearer {b.api_key}"
        return h

    async def chat_completions(self, req: Request) -> Response | StreamResponse:
        """Every chat completion answer says what the response cache did (X-Cache)."""
        resp = await self._chat(req)
        if not any(k == "x-cache" for k, _ in resp.headers):
            resp.headers.append(("x-cache", "BYPASS"))
        return resp

    async def _chat(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = self._parse(req, _oai_err)
        if isinstance(body, Response):
            return body
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required and must be a string", param="model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return openai_error(400, "'messages' must be a non-empty array", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return openai_error(
                400, "each message must be an object with a string 'role'", param="messages"
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return openai_error(400, "'stream' must be a boolean", param="stream")
        caller_salt = body.get("cache_salt")
        if caller_salt is not None and (not isinstance(caller_salt, str) or not caller_salt):
            return openai_error(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        cache = self.cache if self.config.response_cache.enabled else None
        lookup = None
        if cache is not None:
            lookup = await cache.lookup(body, req.headers, stream)
            if lookup.result == "hit":
                return self._cache_hit(lookup.body or b"", stream, started, lookup.mode)
        resp = await self._route_chat(req, body, model, stream, lookup, started)
        if lookup is not None and lookup.result == "miss":
            resp.headers.append(("x-cache", "MISS"))
        return resp

    def _cache_hit(
        self, data: bytes, stream: bool, started: float, mode: str = "exact"
    ) -> Response | StreamResponse:
        """A hit never reaches a backend: the stored JSON, or the stored stream replayed."""
        self.metrics.observe("chat", None, 200, time.perf_counter() - started)
        if stream:
            return StreamResponse(
                200,
                replay_sse(data),
                [
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                    ("x-cache", "HIT"),
                ],
            )
        headers = [("content-type", "application/json"), ("x-cache", "HIT")]
        if mode == "semantic":
            headers.append(("x-cache-mode", "semantic"))
        return Response(200, data, headers)

    async def _route_chat(
        self,
        req: Request,
        body: dict[str, Any],
        model: str,
        stream: bool,
        lookup: CacheLookup | None,
        started: float,
    ) -> Response | StreamResponse:
        candidates, mask = self.pool.candidates(model, "chat")
        if not candidates:
            return self._no_candidates(model, "chat", _oai_err)
        cfg = self.config
        pr = cfg.prefix_routing
        ctx = SelectionContext(
            model,
            extract_prefix_key(body, enabled=pr.enabled, max_prefix_length=pr.max_prefix_length),
            self._affinity(req, body) if cfg.selection_strategy == "ConsistentHash" else None,
        )
        spec = ForwardSpec(
            "chat",
            req.body,
            body,
            stream,
            ctx,
            _chat_path,
            lambda b: self._upstream_headers(b, req),
            _oai_err,
            self._salt_rewriter(ctx.prefix_key),
        )
        if lookup is not None and lookup.result == "miss" and self.cache is not None:
            spec.store = self.cache.writer_for(lookup)
            spec.store_limit = self.cache.limit(stream)
        if self.gemini is not None and any(b.type == "gemini" for b in candidates):
            err = self._gemini_hooks(spec, body, model, stream)
            if err is not None:
                return err
        return await forward(self, spec, candidates, mask, started)

    def _gemini_hooks(
        self,
        spec: ForwardSpec,
        body: dict[str, Any],
        model: str,
        stream: bool,
        dialect: Literal["openai", "anthropic"] = "openai",
    ) -> Response | None:
        """Context cache references and the native API for gemini candidates."""
        from .gemini import TranslationError

        assert self.gemini is not None
        try:
            chat = self.gemini.chat(body, model, stream, dialect)
        except TranslationError as exc:
            if dialect == "anthropic":
                return anthropic_error(400, str(exc))
            return openai_error(400, str(exc), param=exc.param)
        path_for, headers_for, inner = spec.path_for, spec.headers_for, spec.rewrite

        def rewrite(b: Backend, parsed: dict[str, Any], raw: bytes) -> bytes:
            if b.type == "gemini":
                return chat.rewrite(b, parsed, raw)
            return inner(b, parsed, raw) if inner is not None else raw

        spec.path_for = lambda b: chat.path(b, path_for)
        spec.headers_for = lambda b: chat.headers(b, headers_for(b))
        spec.rewrite = rewrite
        spec.adapter = chat
        return None

    def _salt_rewriter(
        self, key: bytes | None
    ) -> Callable[[Backend, dict[str, Any], bytes], bytes] | None:
        """Binds (backend, prefix key) in the forwarded cache_salt, for the KV listener."""
        kv = self.kv
        if kv is None or key is None or kv.salt_secret is None:
            return None

        def rewrite(b: Backend, parsed: dict[str, Any], raw: bytes) -> bytes:
            if not kv.salt_for(b.name, b.type, b.config.cache_salt):
                return raw
            body = dict(parsed)
            body["cache_salt"] = kv.make_salt(b.name, key, parsed.get("cache_salt"))
            return orjson.dumps(body)

        return rewrite

    @staticmethod
    def _affinity(req: Request, body: dict[str, Any]) -> str | None:
        sid = req.headers.get("x-session-id")
        if sid:
            return sid
        user = body.get("user")
        return user if isinstance(user, str) and user else None

    async def embeddings(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = self._parse(req, _oai_err)
        if isinstance(body, Response):
            return body
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required and must be a string", param="model")
        if "input" not in body:
            return openai_error(400, "'input' is required", param="input")
        candidates, mask = self.pool.candidates(model, "embeddings")
        if not candidates:
            return self._no_candidates(model, "embeddings", _oai_err)
        spec = ForwardSpec(
            "embeddings",
            req.body,
            body,
            False,
            SelectionContext(model),
            _embeddings_path,
            lambda b: self._upstream_headers(b, req),
            _oai_err,
        )
        return await forward(self, spec, candidates, mask, started)

    # -- Anthropic Messages --------------------------------------------------------

    def _anthropic_headers(self, b: Backend, req: Request) -> dict[str, str]:
        h = self._forwarded(req)
        h["content-type"] = "application/json"
        h["accept-encoding"] = "identity"
        h["anthropic-version"] = req.headers.get("anthropic-version") or _ANTHROPIC_VERSION
        if b.api_key:
            h["x-api-key"] = b.api_key
        return h

    def _anthropic_rewrite(self, b: Backend, parsed: dict[str, Any], raw: bytes) -> bytes:
        force = self.config.prefix_routing.anthropic_cache_control_injection
        if not should_inject(force, b.config.anthropic_auto_cache_control):
            return raw
        body = orjson.loads(raw)  # a fresh copy: a retry on another backend starts clean
        return orjson.dumps(body) if inject_cache_control(body) else raw

    async def anthropic_messages(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = self._parse(req, _anth_err)
        if isinstance(body, Response):
            return body
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return anthropic_error(400, "'model' is required and must be a string")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return anthropic_error(400, "'messages' must be a non-empty array")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return anthropic_error(400, "'stream' must be a boolean")
        candidates, mask = self.pool.candidates(model, "anthropic")
        via_gemini = False
        if not candidates and self.gemini is not None:
            candidates, mask = self._gemini_candidates(model)
            via_gemini = bool(candidates)
        if not candidates:
            return self._no_candidates(model, "anthropic", _anth_err)
        pr = self.config.prefix_routing
        ctx = SelectionContext(
            model,
            extract_prefix_key(body, enabled=pr.enabled, max_prefix_length=pr.max_prefix_length),
        )
        spec = ForwardSpec(
            "anthropic",
            req.body,
            body,
            stream,
            ctx,
            _messages_path,
            lambda b: self._anthropic_headers(b, req),
            _anth_err,
            self._anthropic_rewrite,
        )
        if via_gemini:
            err = self._gemini_hooks(spec, body, model, stream, "anthropic")
            if err is not None:
                return err
        return await forward(self, spec, candidates, mask, started)

    def _gemini_candidates(self, model: str) -> tuple[tuple[Backend, ...], int]:
        """Gemini backends of ``model``: they answer Anthropic Messages over the native API."""
        found = tuple(b for b in self.pool.candidates(model, "chat")[0] if b.type == "gemini")
        mask = 0
        for b in found:
            mask |= 1 << b.index
        return found, mask

    # -- plain endpoints -----------------------------------------------------------

    async def list_models(self, req: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": owner}
            for m, owner in self.pool.models()
        ]
        return Response(200, orjson.dumps({"object": "list", "data": data}), _JSON_HEADERS)

    async def health(self, req: Request) -> Response:
        healthy = sum(1 for b in self.pool.backends if b.healthy and b.config.enabled)
        body = {"status": "ok", "backends": {"healthy": healthy, "total": len(self.pool.backends)}}
        return Response(200, orjson.dumps(body), _JSON_HEADERS)

    async def render_metrics(self, req: Request) -> Response:
        return Response(200, self.metrics.render(), [("content-type", CONTENT_TYPE)])

    # -- admin ---------------------------------------------------------------------

    def _admin_ok(self, req: Request) -> bool:
        if self.admin_token is None:
            return True
        auth = req.headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self.admin_token)

    @staticmethod
    def _unauthorized() -> Response:
        return openai_error(
            401,
            "admin endpoints require 'Authorization: Bearer <admin token>'",
            "authentication_error",
            "unauthorized",
            headers=[("www-authenticate", "Bearer")],
        )

    async def admin_kv_stats(self, req: Request) -> Response:
        if self.kv is None:
            return _disabled()
        return Response(200, orjson.dumps(await self.kv.admin_stats()), _JSON_HEADERS)

    async def admin_kv_backends(self, req: Request) -> Response:
        if self.kv is None:
            return _disabled()
        return Response(200, orjson.dumps(self.kv.admin_backends()), _JSON_HEADERS)

    async def admin_kv_clear(self, req: Request) -> Response:
        if self.kv is None:
            return openai_error(409, "the KV cache index is not enabled", code="kv_index_disabled")
        return Response(200, orjson.dumps(await self.kv.clear()), _JSON_HEADERS)

    async def admin_cache_stats(self, req: Request) -> Response:
        if self.cache is None:
            return _disabled()
        return Response(200, orjson.dumps(await self.cache.admin_stats()), _JSON_HEADERS)

    async def admin_cache_invalidate(self, req: Request) -> Response:
        if self.cache is None:
            return openai_error(409, "the response cache is not enabled", code="cache_disabled")
        body = self._parse(req, _oai_err)
        if isinstance(body, Response):
            return body
        result = await self.cache.invalidate(body)
        if result is None:
            return openai_error(
                400, 'expected {"clear_all": true} or {"key": "<64 hex cache key>"}'
            )
        return Response(200, orjson.dumps(result), _JSON_HEADERS)

    async def admin_gemini_stats(self, req: Request) -> Response:
        return Response(200, orjson.dumps(gemini_context_cache_stats(self)), _JSON_HEADERS)

    async def admin_gemini_clear(self, req: Request) -> Response:
        cache = self.gemini.cache if self.gemini is not None else None
        if cache is None:
            body: dict[str, Any] = {
                "success": False,
                "error": "Gemini context cache is not enabled",
            }
        else:
            body = {"success": True, "cleared_entries": await cache.clear()}
        return Response(200, orjson.dumps(body), _JSON_HEADERS)

    async def admin_prefix_stats(self, req: Request) -> Response:
        return Response(200, orjson.dumps(prefix_routing_stats(self)), _JSON_HEADERS)


def _disabled() -> Response:
    return Response(200, orjson.dumps({"enabled": False}), _JSON_HEADERS)


def _build_response_cache(
    config: RouterConfig, pools: Any, metrics: RouterMetrics
) -> ResponseCacheService:
    from .cache import build_cache_store

    rc = config.response_cache
    store = build_cache_store(
        rc.backend,
        rc.capacity,
        rc.ttl_seconds,
        rc.redis,
        pools,
        **metrics.cache_store_hooks(),
    )
    return ResponseCacheService(rc, store, metrics.cache_result)


def _oai_err(status: int, message: str, code: str | None = None) -> Response:
    etype = "invalid_request_error" if status < 500 else "api_error"
    return openai_error(status, message, etype, code)


def _anth_err(status: int, message: str, code: str | None = None) -> Response:
    return anthropic_error(status, message, code)
