"""``POST /anthropic/v1/messages``: the Anthropic Messages API, streaming or not.

Requests go to ``type: anthropic`` backends (``/v1/messages``, the backend's key as
``x-api-key``, ``anthropic-version`` from the client or 2023-06-01), with Anthropic's
prompt-caching marker on the last system block (:mod:`.cache_control`). For a model no
anthropic backend serves, the model's ``type: gemini`` backends answer through the Gemini
adapter over the native API, when the Gemini context cache or the native API is
configured. Errors use Anthropic's shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import orjson

from bus.prefix_key import extract_prefix_key

from ..config import RouterConfig
from ..errors import anthropic_error
from ..forward_spec import ForwardSpec
from ..forwarder import Forwarder
from ..gemini import GeminiService, TranslationError
from ..http.types import Request, Response, StreamResponse
from ..pool import Backend, BackendPool
from ..selection import SelectionContext
from .base import PassThroughAnswers, anthropic_errors, forwarded_headers, no_candidates, parse_body
from .cache_control import inject_cache_control, should_inject

__all__ = ["ANTHROPIC_VERSION", "AnthropicMessages"]

ANTHROPIC_VERSION = "2023-06-01"
"""Sent when the client names none."""


class AnthropicMessages(PassThroughAnswers):
    """The messages handler and its upstream format.

    Args:
        config: the running config, read once per request.
        pool: candidates per model.
        forwarder: sends the prepared request.
        gemini: the Gemini adapter factory, when configured (gemini backends then answer
            Anthropic requests for models no anthropic backend serves).
    """

    def __init__(
        self,
        *,
        config: Callable[[], RouterConfig],
        pool: BackendPool,
        forwarder: Forwarder,
        gemini: GeminiService | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._forwarder = forwarder
        self._gemini = gemini

    async def handle(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = parse_body(req, anthropic_errors)
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
        candidates, mask = self._pool.candidates(model, "anthropic")
        via_gemini = False
        if not candidates and self._gemini is not None:
            candidates, mask = self._gemini_candidates(model)
            via_gemini = bool(candidates)
        if not candidates:
            return no_candidates(self._pool, model, "anthropic", anthropic_errors)
        pr = self._config().prefix_routing
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
            forwarded_headers(req),
            self,
            anthropic_errors,
        )
        if via_gemini:
            assert self._gemini is not None
            try:
                spec.gemini = self._gemini.chat(body, model, stream, self, dialect="anthropic")
            except TranslationError as exc:
                return anthropic_error(400, str(exc))
        return await self._forwarder.forward(spec, candidates, mask, started)

    def _gemini_candidates(self, model: str) -> tuple[tuple[Backend, ...], int]:
        """Gemini backends of ``model``: they answer Anthropic Messages over the native API."""
        found = tuple(b for b in self._pool.candidates(model, "chat")[0] if b.type == "gemini")
        mask = 0
        for b in found:
            mask |= 1 << b.index
        return found, mask

    # -- upstream format ---------------------------------------------------------------

    def path(self, backend: Backend) -> str:
        return "/v1/messages"

    def headers(self, backend: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        h = dict(forwarded)
        h["content-type"] = "application/json"
        h["accept-encoding"] = "identity"
        h["anthropic-version"] = forwarded.get("anthropic-version") or ANTHROPIC_VERSION
        if backend.api_key:
            h["x-api-key"] = backend.api_key
        return h

    def body(self, backend: Backend, spec: ForwardSpec) -> bytes:
        """With the cache_control marker when the backend (or the config) asks for it."""
        force = self._config().prefix_routing.anthropic_cache_control_injection
        if not should_inject(force, backend.config.anthropic_auto_cache_control):
            return spec.body
        body = orjson.loads(spec.body)  # a fresh copy: a retry on another backend starts clean
        return orjson.dumps(body) if inject_cache_control(body) else spec.body
