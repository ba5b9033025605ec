"""What ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` share: one
request flow over a parsed body.

Each of the three dialects turns its client's body into a :class:`Prepared` (validation,
the prefix anchor, the prompt chain, the response cache's view of the request, a pinned
backend); :class:`GenerationDialect` does the rest:

1. the response cache when enabled and the request is deterministic (``Prepared.cache_view``
   is not None): a hit is answered without a backend; every answer carries
   ``X-Cache: HIT | MISS | BYPASS``;
2. candidates: enabled, healthy, public backends of the model whose type serves the
   endpoint (404/503 otherwise); a pinned backend (a Responses request continuing a
   response the router relayed) narrows them to that one while it is a candidate;
3. the selection context: the prefix key from the anchor (``bus.prefix_key``, with
   ``prefix_routing.max_prefix_length``), for ``ConsistentHash`` the session affinity,
   and with conversation-depth routing the prompt chain;
4. forward, with the cache write-back of a miss, once the dialect's
   :meth:`GenerationDialect.adapt` has had its say (the chat dialect's Gemini adapter).

Upstream the body goes as sent, or with its ``cache_salt`` bound to the chosen backend
(:mod:`.cache_salt`) when the dialect allows it (:meth:`GenerationDialect.saltable`).

The cache's view of a chat request is its body; for the other two it is a chat-shaped body
whose ``messages`` is an object naming the endpoint and its input (``{"completions":
prompt}``, ``{"responses": {...}}``): the key function (:mod:`router.cache.response`) is
the chat one, and an object can never equal a chat request's message array, so the three
APIs never share an entry (nor take the semantic path, which needs a message array).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bus.prefix_key import PrefixTag, compute_prefix_key

from ..cache.response import ineligible_reason
from ..cache.service import CacheLookup, ResponseCacheService
from ..config import RouterConfig
from ..conversation import ConversationKeys, RequestChain
from ..forward_spec import ForwardSpec
from ..forwarder import Forwarder
from ..http.types import Request, Response, StreamResponse
from ..openai_api import bearer_headers
from ..pool import Backend, BackendPool, Endpoint
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

__all__ = ["GenerationDialect", "Observe", "Prepared", "cache_view"]

Observe = Callable[[str, str | None, int, float], None]
"""``RouterMetrics.observe``: (endpoint, backend, status, seconds)."""


@dataclass(slots=True)
class Prepared:
    """One validated request, as the shared flow needs it."""

    model: str
    stream: bool
    anchor: tuple[PrefixTag, str] | None
    """The prefix key's tag and text (None: no text to anchor on)."""
    chain: Callable[[], RequestChain | None] | None = None
    """Computes the prompt chain when conversation-depth routing is on (None: no chain)."""
    cache_view: dict[str, Any] | None = None
    """The chat-shaped body the response cache keys (None: never cached, BYPASS)."""
    pinned: str | None = None
    """A backend the request must go to while it is a candidate."""


def cache_view(
    body: Mapping[str, Any], endpoint: str, keyed: Any, unkeyed: tuple[str, ...]
) -> dict[str, Any] | None:
    """The response cache's view of ``body`` (see the module docstring), or None when a
    field in ``unkeyed`` (output-shaping, not in the key) or the chat rules make it
    ineligible."""
    for name in unkeyed:
        if body.get(name) not in (None, False):
            return None
    view = dict(body)
    view["messages"] = {endpoint: keyed}
    return view if ineligible_reason(view) is None else None


class GenerationDialect(PassThroughAnswers):
    """The shared flow and upstream format; subclasses give ``endpoint``, ``upstream_path``
    and :meth:`prepare`.

    Args:
        config: the running config, read once per request.
        pool: candidates per model.
        forwarder: sends the prepared request.
        observe: request metrics, for answers that never reach a backend (cache hits).
        cache: the response cache service, once built (``Router.apply_config`` sets it).
        salter: the cache-salt step, when a salt secret is configured.
        conversation: the prompt chains' keys, with conversation-depth routing.
    """

    endpoint: Endpoint
    upstream_path: str

    def __init__(
        self,
        *,
        config: Callable[[], RouterConfig],
        pool: BackendPool,
        forwarder: Forwarder,
        observe: Observe,
        cache: ResponseCacheService | None = None,
        salter: CacheSalter | None = None,
        conversation: ConversationKeys | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._forwarder = forwarder
        self._observe = observe
        self.cache = cache
        self._salter = salter
        self._conversation = conversation

    def prepare(self, body: dict[str, Any]) -> Prepared | Response:
        """Validate ``body``; the 400 to answer with (naming the field) when it is bad."""
        raise NotImplementedError

    async def handle(self, req: Request) -> Response | StreamResponse:
        """Every answer says what the response cache did (X-Cache)."""
        resp = await self._handle(req)
        if not any(k == "x-cache" for k, _ in resp.headers):
            resp.headers.append(("x-cache", "BYPASS"))
        return resp

    async def _handle(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = parse_body(req, openai_errors)
        if isinstance(body, Response):
            return body
        prepared = self.prepare(body)
        if isinstance(prepared, Response):
            return prepared
        cfg = self._config()
        cache = self.cache if cfg.response_cache.enabled else None
        lookup = None
        if cache is not None and prepared.cache_view is not None:
            lookup = await cache.lookup(prepared.cache_view, req.headers, prepared.stream)
            if lookup.result == "hit":
                self._observe(self.endpoint, None, 200, time.perf_counter() - started)
                return cached_answer(lookup.body or b"", prepared.stream, lookup.mode)
        resp = await self._route(req, cfg, body, prepared, lookup, started)
        if lookup is not None and lookup.result == "miss":
            resp.headers.append(("x-cache", "MISS"))
        return resp

    async def _route(
        self,
        req: Request,
        cfg: RouterConfig,
        body: dict[str, Any],
        prepared: Prepared,
        lookup: CacheLookup | None,
        started: float,
    ) -> Response | StreamResponse:
        model = prepared.model
        candidates, mask = self._pool.candidates(model, self.endpoint)
        if not candidates:
            return no_candidates(self._pool, model, self.endpoint, openai_errors)
        pinned = next((b for b in candidates if b.name == prepared.pinned), None)
        if pinned is not None:
            candidates, mask = (pinned,), 1 << pinned.index
        pr = cfg.prefix_routing
        key = None
        if pr.enabled and prepared.anchor is not None:
            key = compute_prefix_key(model, *prepared.anchor, pr.max_prefix_length)
        ctx = SelectionContext(
            model,
            key,
            session_affinity(req.headers, body)
            if cfg.selection_strategy == "ConsistentHash"
            else None,
            prepared.chain() if prepared.chain is not None and pr.enabled else None,
        )
        spec = ForwardSpec(
            self.endpoint,
            req.body,
            body,
            prepared.stream,
            ctx,
            forwarded_headers(req),
            self,
            openai_errors,
        )
        if lookup is not None and lookup.result == "miss" and self.cache is not None:
            spec.store = self.cache.writer_for(lookup)
            spec.store_limit = self.cache.limit(prepared.stream)
        refused = self.adapt(spec, candidates)
        if refused is not None:
            return refused
        return await self._forwarder.forward(spec, candidates, mask, started)

    def adapt(self, spec: ForwardSpec, candidates: tuple[Backend, ...]) -> Response | None:
        """Attach what some candidates need beyond the upstream format, or the 400 to
        answer with when the request cannot be given to them."""
        return None

    # -- upstream format ---------------------------------------------------------------

    def path(self, backend: Backend) -> str:
        return self.upstream_path

    def headers(self, backend: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        return bearer_headers(backend, forwarded)

    def body(self, backend: Backend, spec: ForwardSpec) -> bytes:
        """As sent, or with the cache salt bound to ``backend`` (:mod:`.cache_salt`)."""
        salter, key = self._salter, spec.ctx.prefix_key
        if salter is None or key is None or not salter.applies(backend):
            return spec.body
        if not self.saltable(spec.parsed):
            return spec.body
        return salter.salted_body(backend, key, spec.parsed)

    def saltable(self, body: Mapping[str, Any]) -> bool:
        """Whether every prompt of ``body`` starts with its prefix key's anchor, so the
        engine's salt echo names the right key (a batch of prompts does not)."""
        return True
