"""The seam between the HTTP server library and the router.

Handlers and the pipeline see only these types, so the server (granian's RSGI core
today) can be swapped by rewriting one adapter module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["Handler", "Request", "Response", "StreamResponse"]


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    """Header lookup by lower-case name."""
    body: bytes
    client: str = ""


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class StreamResponse:
    """A response whose body is produced while it is sent.

    The adapter iterates ``body`` and writes each chunk as it arrives. When the client
    goes away the adapter closes the iterator (``aclose``), so the generator's
    ``finally`` runs and can cancel the upstream request.
    """

    status: int
    body: AsyncIterator[bytes]
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
