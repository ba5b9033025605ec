"""``POST /v1/embeddings``: OpenAI embeddings, to any backend type that serves them.

``type: gemini`` backends are reached on Google's OpenAI-compatible path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..errors import openai_error
from ..forward_spec import ForwardSpec
from ..forwarder import Forwarder
from ..http.types import Request, Response, StreamResponse
from ..openai_api import bearer_headers, embeddings_path
from ..pool import Backend, BackendPool
from ..selection import SelectionContext
from .base import (
    PassThroughAnswers,
    forwarded_headers,
    no_candidates,
    openai_errors,
    parse_body,
)

__all__ = ["Embeddings"]


class Embeddings(PassThroughAnswers):
    """The embeddings handler and its upstream format."""

    def __init__(self, *, pool: BackendPool, forwarder: Forwarder) -> None:
        self._pool = pool
        self._forwarder = forwarder

    async def handle(self, req: Request) -> Response | StreamResponse:
        started = time.perf_counter()
        body = parse_body(req, openai_errors)
        if isinstance(body, Response):
            return body
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required and must be a string", param="model")
        if "input" not in body:
            return openai_error(400, "'input' is required", param="input")
        candidates, mask = self._pool.candidates(model, "embeddings")
        if not candidates:
            return no_candidates(self._pool, model, "embeddings", openai_errors)
        spec = ForwardSpec(
            "embeddings",
            req.body,
            body,
            False,
            SelectionContext(model),
            forwarded_headers(req),
            self,
            openai_errors,
        )
        return await self._forwarder.forward(spec, candidates, mask, started)

    def path(self, backend: Backend) -> str:
        return embeddings_path(backend)

    def headers(self, backend: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        return bearer_headers(backend, forwarded)

    def body(self, backend: Backend, spec: ForwardSpec) -> bytes:
        return spec.body
