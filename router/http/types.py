"""The seam between the HTTP server library and the router.

Handlers and the pipeline see only these types, so the server (granian's RSGI core
today) can be swapped by rewriting one adapter module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Handler", "Headers", "Request", "Response", "StreamResponse"]


class Headers(Protocol):
    """Read access to request headers by lower-case name (a dict is one; so is the server
    adapter's view of its own header map, which is not copied)."""

    def get(self, key: str, /) -> str | None: ...
    def __getitem__(self, key: str, /) -> str: ...
    def __contains__(self, key: object, /) -> bool: ...
    def items(self) -> Iterable[tuple[str, str]]: ...


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: Headers
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
