"""What a dialect hands the forwarder: the request as data, and how it goes upstream.

:class:`ForwardSpec` is plain data about one client request. :class:`UpstreamFormat` is
how that request goes to one backend and how the backend's answer comes back: a dialect
(``router.dialects``) is the format for the backends that speak its API, the Gemini
adapter (``router.gemini.chat``) for ``type: gemini`` backends. The
:class:`~router.forwarder.Forwarder` picks one per attempt with
:meth:`ForwardSpec.format_for`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .http.types import Response
from .pool import Backend, Endpoint
from .selection import SelectionContext

__all__ = [
    "ACCOUNT_HEADERS",
    "CacheWrite",
    "ErrorFactory",
    "ForwardSpec",
    "RoutingFeedback",
    "UpstreamFormat",
    "headers_for",
]

ErrorFactory = Callable[[int, str, str | None], Response]
"""``(status, message, code)`` -> an error response in the client's API shape."""


class UpstreamFormat(Protocol):
    """How one request goes to one backend, and how that backend's answer comes back.

    A dialect implements it for the backends that speak the client's API; the Gemini
    adapter for ``type: gemini`` backends. Every method gets the chosen backend.
    """

    def path(self, backend: Backend) -> str:
        """The path appended to the backend's URL."""
        ...

    def headers(self, backend: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        """Request headers: the client's end-to-end ``forwarded`` ones plus the backend's."""
        ...

    def body(self, backend: Backend, spec: ForwardSpec) -> bytes:
        """The request body for this backend (a retry on another backend starts clean)."""
        ...

    def retry(self, backend: Backend, status: int, data: bytes) -> bool:
        """Whether a non-200 whole answer asks for the request to be sent again (once)."""
        ...

    def transform(self, backend: Backend, status: int, data: bytes) -> bytes:
        """A whole answer body as the client should see it."""
        ...

    def stream(self, backend: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A 200 stream's bytes as the client should see them."""
        ...


ACCOUNT_HEADERS: frozenset[str] = frozenset(
    ("openai-organization", "openai-project", "anthropic-beta", "x-goog-user-project")
)
"""Client headers that choose an account, project or billed feature at the provider.

With the operator's key (``api_key_env``) they would scope or bill the operator's account
as the caller chose, so they are dropped for a backend the router authenticates to; a
backend it sends no key to gets them as the caller sent them."""


def headers_for(backend: Backend, forwarded: Mapping[str, str]) -> Mapping[str, str]:
    """``forwarded`` as it may reach ``backend``: without ``ACCOUNT_HEADERS`` when the router
    sends the backend its own key."""
    if not backend.api_key:
        return forwarded
    return {k: v for k, v in forwarded.items() if k not in ACCOUNT_HEADERS}


CacheWrite = Callable[[bytes, bool], None]
"""The response cache's write-back of one request (``ResponseCacheService.writer_for``):
``(complete 200 body, stream)``."""


@dataclass(slots=True)
class ForwardSpec:
    """Everything the forwarder needs about one request, prepared by its dialect."""

    endpoint: Endpoint
    """Metric label and candidate class: chat, anthropic, embeddings."""
    body: bytes
    """The body as the client sent it."""
    parsed: dict[str, Any]
    """``body`` parsed; never mutated (formats copy before rewriting)."""
    stream: bool
    ctx: SelectionContext
    forwarded: Mapping[str, str]
    """The client's end-to-end headers (hop-by-hop and credentials already dropped; the
    forwarder drops ``ACCOUNT_HEADERS`` too for a backend with the operator's key)."""
    format: UpstreamFormat
    """The dialect: how the request goes to a backend that speaks the client's API."""
    error: ErrorFactory
    """Errors in the client's API shape."""
    gemini: UpstreamFormat | None = None
    """The Gemini adapter of this request, used instead of ``format`` for gemini backends."""
    store: CacheWrite | None = None
    """Response cache write-back: called with a complete 200 body (``stream`` flag) that
    fits ``store_limit``; never for errors, aborted or oversized streams."""
    store_limit: int = 0
    """Largest body (non-streaming) or stream (streaming) that may be stored."""

    def format_for(self, backend: Backend) -> UpstreamFormat:
        if self.gemini is not None and backend.type == "gemini":
            return self.gemini
        return self.format


class RoutingFeedback(Protocol):
    """What the forwarder tells the router's routing model about a request it sent.

    Conversation-depth routing counts the prompt tokens each backend is still prefilling
    (a load signal of its cost model) and compares the cached tokens it predicted for the
    chosen backend with what the engine reports (``usage.prompt_tokens_details``).
    """

    def sent(self, backend: Backend, ctx: SelectionContext) -> object | None:
        """The request goes to ``backend``; returns a ticket for :meth:`answered`."""
        ...

    def answered(self, ticket: object | None) -> None:
        """The backend answered (first byte) or the attempt failed. Idempotent."""
        ...

    def delivered(self, backend: Backend, ctx: SelectionContext, usage: Mapping[str, Any]) -> None:
        """The answer's OpenAI ``usage`` object."""
        ...
