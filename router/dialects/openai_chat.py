"""``POST /v1/chat/completions``: OpenAI chat completions, streaming or not.

Steps of one request, in order:

1. parse and validate the body (model, messages, stream, cache_salt), OpenAI errors;
2. the response cache (Tiers 2 and 3) when enabled: a hit is answered without a backend
   (the stored JSON, or the stored stream replayed as SSE); every answer carries
   ``X-Cache: HIT | MISS | BYPASS``;
3. candidates: enabled, healthy, public backends of the model (404/503 otherwise);
4. the selection context: the prefix key (Tier 1, ``bus.prefix_key``), for
   ``ConsistentHash`` the session affinity (``x-session-id`` header, else ``user``), and
   with conversation-depth routing the prompt chain (``router.conversation``: the body
   rendered with the model's chat template; None when it cannot be, and the prefix key
   routes it);
5. forward (:class:`~router.forwarder.Forwarder`), with the cache write-back of a miss.

Upstream, for backends that speak OpenAI's API: ``/v1/chat/completions`` (gemini's
OpenAI-compatible path for ``type: gemini``), the backend's bearer key, and the body as
sent, or with its cache salt bound to the chosen backend (:mod:`.cache_salt`).
``type: gemini`` backends get the Gemini adapter instead when one is configured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from bus.prefix_key import extract_prefix_key

from ..cache.service import CacheLookup, ResponseCacheService
from ..config import RouterConfig
from ..conversation import ConversationKeys
from ..errors import openai_error
from ..forward_spec import ForwardSpec
from ..forwarder import Forwarder
from ..gemini import GeminiService, TranslationError
from ..http.types import Request, Response, StreamResponse
from ..openai_api import bearer_headers, chat_path
from ..pool import Backend, BackendPool
from ..selection import SelectionContext
from .base import (
    PassThroughAnswers,
    cached_answer,
    forwarded_headers,
    no_candidates,
    openai_errors,
    parse_body,
    session_affinity,
)
from .cache_salt import CacheSalter

__all__ = ["ChatCompletions"]

Observe = Callable[[str, str | None, int, float], None]
"""``RouterMetrics.observe``: (endpoint, backend, status, seconds)."""


class ChatCompletions(PassThroughAnswers):
    """The chat completions handler and its upstream format.

    Args:
        config: the running config, read once per request (a reload swaps it whole).
        pool: candidates per model.
        forwarder: sends the prepared request.
        observe: request metrics, for answers that never reach a backend (cache hits).
        cache: the response cache service, once built (at start, or by the reload that
            turns ``response_cache.enabled`` on: ``Router.apply_config`` sets it).
        gemini: the Gemini adapter factory, when the context cache or the native API is on.
        salter: the cache-salt step, when a salt secret is configured.
        conversation: renders the request into its prompt chain (conversation-depth
            routing), when configured.
    """

    def __init__(
        self,
        *,
        config: Callable[[], RouterConfig],
        pool: BackendPool,
        forwarder: Forwarder,
        observe: Observe,
        cache: ResponseCacheService | None = None,
        gemini: GeminiService | None = None,
        salter: CacheSalter | None = None,
        conversation: ConversationKeys | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._forwarder = forwarder
        self._observe = observe
        self.cache = cache
        self._gemini = gemini
        self._salter = salter
        self._conversation = conversation

    async def handle(self, req: Request) -> Response | StreamResponse:
        """Every chat completion answer says what the response cache did (X-Cache)."""
        resp = await self._chat(req)
        if not any(k == "x-cache" for k, _ in resp.headers):
            resp.headers.append(("x-cache", "BYPASS"))
        return resp

    async def _chat(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = parse_body(req, openai_errors)
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
        cfg = self._config()
        cache = self.cache if cfg.response_cache.enabled else None
        lookup = None
        if cache is not None:
            lookup = await cache.lookup(body, req.headers, stream)
            if lookup.result == "hit":
                return self._cache_hit(lookup.body or b"", stream, started, lookup.mode)
        resp = await self._route(req, cfg, body, model, stream, lookup, started)
        if lookup is not None and lookup.result == "miss":
            resp.headers.append(("x-cache", "MISS"))
        return resp

    def _cache_hit(
        self, data: bytes, stream: bool, started: float, mode: str = "exact"
    ) -> Response | StreamResponse:
        """A hit never reaches a backend: the stored JSON, or the stored stream replayed."""
        self._observe("chat", None, 200, time.perf_counter() - started)
        return cached_answer(data, stream, mode)

    async def _route(
        self,
        req: Request,
        cfg: RouterConfig,
        body: dict[str, Any],
        model: str,
        stream: bool,
        lookup: CacheLookup | None,
        started: float,
    ) -> Response | StreamResponse:
        candidates, mask = self._pool.candidates(model, "chat")
        if not candidates:
            return no_candidates(self._pool, model, "chat", openai_errors)
        pr = cfg.prefix_routing
        ctx = SelectionContext(
            model,
            extract_prefix_key(body, enabled=pr.enabled, max_prefix_length=pr.max_prefix_length),
            session_affinity(req.headers, body)
            if cfg.selection_strategy == "ConsistentHash"
            else None,
            # The client's body, before the salt step binds a backend: the chain's root
            # takes the caller's own cache_salt, which the listener recovers too.
            (
                self._conversation.chain(body, model)
                if self._conversation is not None and pr.enabled
                else None
            ),
        )
        spec = ForwardSpec(
            "chat", req.body, body, stream, ctx, forwarded_headers(req), self, openai_errors
        )
        if lookup is not None and lookup.result == "miss" and self.cache is not None:
            spec.store = self.cache.writer_for(lookup)
            spec.store_limit = self.cache.limit(stream)
        if self._gemini is not None and any(b.type == "gemini" for b in candidates):
            try:
                spec.gemini = self._gemini.chat(body, model, stream, self)
            except TranslationError as exc:
                return openai_error(400, str(exc), param=exc.param)
        return await self._forwarder.forward(spec, candidates, mask, started)

    # -- upstream format ---------------------------------------------------------------

    def path(self, backend: Backend) -> str:
        return chat_path(backend)

    def headers(self, backend: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        return bearer_headers(backend, forwarded)

    def body(self, backend: Backend, spec: ForwardSpec) -> bytes:
        """As sent, or with the cache salt bound to ``backend`` (:mod:`.cache_salt`)."""
        salter, key = self._salter, spec.ctx.prefix_key
        if salter is None or key is None or not salter.applies(backend):
            return spec.body
        return salter.salted_body(backend, key, spec.parsed)
