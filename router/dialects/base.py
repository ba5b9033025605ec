"""What every request dialect shares: body parsing, header forwarding, error shapes.

A dialect is one client API the router speaks (OpenAI chat completions, Anthropic
messages, OpenAI embeddings). It validates the client's request, prepares a
:class:`~router.forwarder.ForwardSpec`, and is the request's
:class:`~router.forwarder.UpstreamFormat` for the backends that speak the same API: the
answer side of those is a pass-through (:class:`PassThroughAnswers`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from ..cache.response import replay_sse
from ..errors import anthropic_error, openai_error
from ..forward_spec import ErrorFactory
from ..http.types import Headers, Request, Response, StreamResponse
from ..pool import Backend, BackendPool, Endpoint

__all__ = [
    "PassThroughAnswers",
    "anthropic_errors",
    "cached_answer",
    "forwarded_headers",
    "no_candidates",
    "openai_errors",
    "parse_body",
    "session_affinity",
]

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


def forwarded_headers(req: Request) -> dict[str, str]:
    """The client's end-to-end headers (tracing, request ids, vendor extensions).

    Hop-by-hop headers, the client's credentials (the router authenticates to the
    backend with the backend's own key) and the headers the router sets are dropped.
    """
    return {k: v for k, v in req.headers.items() if k not in _NOT_FORWARDED}


def openai_errors(status: int, message: str, code: str | None = None) -> Response:
    etype = "invalid_request_error" if status < 500 else "api_error"
    return openai_error(status, message, etype, code)


def anthropic_errors(status: int, message: str, code: str | None = None) -> Response:
    return anthropic_error(status, message, code)


def parse_body(req: Request, error: ErrorFactory) -> dict[str, Any] | Response:
    """The request's JSON object, or the 400 to answer with."""
    try:
        body = orjson.loads(req.body)
    except orjson.JSONDecodeError as exc:
        return error(400, f"request body is not valid JSON: {exc}", "invalid_json")
    if not isinstance(body, dict):
        return error(400, "request body must be a JSON object", "invalid_json")
    return body


def no_candidates(
    pool: BackendPool, model: str, endpoint: Endpoint, error: ErrorFactory
) -> Response:
    """404 for a model nobody serves, 503 for one whose backends are all down."""
    if pool.knows_model(model, endpoint):
        return error(503, f"no healthy backend is available for model '{model}'", "no_backend")
    return error(404, f"the model '{model}' is not served by any backend", "model_not_found")


def cached_answer(data: bytes, stream: bool, mode: str = "exact") -> Response | StreamResponse:
    """A response cache hit: the stored JSON, or the stored stream replayed as SSE."""
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


def session_affinity(headers: Headers, body: Mapping[str, Any]) -> str | None:
    """ConsistentHash's key: the ``x-session-id`` header, else the ``user`` field."""
    sid = headers.get("x-session-id")
    if sid:
        return sid
    user = body.get("user")
    return user if isinstance(user, str) and user else None


class PassThroughAnswers:
    """The answer side of a backend that speaks the client's API: relayed untouched."""

    def retry(self, backend: Backend, status: int, data: bytes) -> bool:
        return False

    def transform(self, backend: Backend, status: int, data: bytes) -> bytes:
        return data

    def stream(self, backend: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return chunks
