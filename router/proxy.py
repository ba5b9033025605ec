"""Forwarding one client request to a selected backend, streaming or not.

Invariants:
* A backend's in-flight count is raised once it is selected and lowered exactly once,
  when its response has been fully sent, failed, or the client went away.
* Only a connect failure is retried, once, on the next candidate: then the engine never
  saw the request, so retrying cannot run a generation twice.
  The one other retry is the adapter's (``ForwardSpec.adapter``): a Gemini request whose
  cache reference the backend no longer knows was refused before any generation.
* Streams are relayed chunk by chunk as they arrive, never buffered whole. Closing the
  relay (client disconnect) closes the upstream connection, which aborts the engine's
  generation.
* A backend's garbage never reaches the client as a success: it becomes 502 naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from .http.types import Response, StreamResponse
from .selection import SelectionContext
from .upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)

if TYPE_CHECKING:
    from .app import Router
    from .pool import Backend

__all__ = ["ForwardSpec", "ResponseAdapter", "forward"]

_SSE = "text/event-stream"

ErrorFactory = Callable[[int, str, str | None], Response]


class ResponseAdapter(Protocol):
    """Per-request answer rewriting for dialects the client does not speak (Gemini)."""

    def retry(self, backend: Backend, status: int, data: bytes) -> bool:
        """Whether a non-200 answer asks for the request to be sent again (once)."""
        ...

    def transform(self, backend: Backend, status: int, data: bytes) -> bytes:
        """A whole answer body as the client should see it."""
        ...

    def stream_chunks(self, backend: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A 200 stream's bytes as the client should see them."""
        ...


@dataclass(slots=True)
class ForwardSpec:
    """Everything the proxy needs about one request, prepared by its handler."""

    endpoint: str
    """Metric label and candidate class: chat, anthropic, embeddings."""
    body: bytes
    parsed: dict[str, Any]
    stream: bool
    ctx: SelectionContext
    path_for: Callable[[Backend], str]
    headers_for: Callable[[Backend], dict[str, str]]
    error: ErrorFactory
    rewrite: Callable[[Backend, dict[str, Any], bytes], bytes] | None = None
    """Per-backend body rewrite (cache_control injection), given the chosen backend."""
    store: Callable[[bytes, bool], None] | None = None
    """Response cache write-back: called with a complete 200 body (``stream`` flag) that
    fits the size limit; never for errors, aborted or oversized streams."""
    store_limit: int = 0
    """Largest body (non-streaming) or stream (streaming) that may be stored."""
    adapter: ResponseAdapter | None = None
    """Answer rewriting and the one stale-reference retry (Gemini backends)."""


async def forward(
    router: Router, spec: ForwardSpec, candidates: Sequence[Backend], mask: int, started: float
) -> Response | StreamResponse:
    metrics = router.metrics
    pool = router.pool
    attempts = 0
    while True:
        backend = await router.selector.select(candidates, mask, spec.ctx)
        body = spec.rewrite(backend, spec.parsed, spec.body) if spec.rewrite else spec.body
        backend.in_flight += 1
        t0 = time.perf_counter()
        try:
            up = await router.client.request(
                backend.name,
                "POST",
                backend.url + spec.path_for(backend),
                spec.headers_for(backend),
                body,
            )
        except UpstreamConnectError as exc:
            backend.in_flight -= 1
            backend.record_outcome(False)
            pool.connect_failed(backend)
            attempts += 1
            rest = tuple(c for c in candidates if c is not backend)
            if attempts == 1 and rest:
                metrics.retry(backend.name)
                candidates = rest
                mask &= ~(1 << backend.index)
                continue
            return _fail(
                router, spec, backend, 502, f"backend {backend.name}: {exc.detail}", started
            )
        except UpstreamTimeout as exc:
            backend.in_flight -= 1
            backend.record_outcome(False)
            return _fail(
                router, spec, backend, 504, f"backend {backend.name}: {exc.detail}", started
            )
        except UpstreamError as exc:
            backend.in_flight -= 1
            backend.record_outcome(False)
            return _fail(
                router, spec, backend, 502, f"backend {backend.name}: {exc.detail}", started
            )
        except BaseException:
            backend.in_flight -= 1
            raise
        backend.record_latency(time.perf_counter() - t0)
        if spec.stream and up.status == 200:
            return _relay(router, spec, backend, up, started)
        resp = await _whole(router, spec, backend, up, started)
        if resp is not None:
            return resp
        # The adapter asked for one more attempt (a Gemini cache reference had expired).


def _fail(
    router: Router,
    spec: ForwardSpec,
    backend: Backend | None,
    status: int,
    msg: str,
    started: float,
) -> Response:
    router.metrics.observe(
        spec.endpoint, backend.name if backend else None, status, time.perf_counter() - started
    )
    code = "upstream_timeout" if status == 504 else "bad_gateway"
    return spec.error(status, msg, code)


async def _whole(
    router: Router, spec: ForwardSpec, backend: Backend, up: UpstreamResponse, started: float
) -> Response | None:
    """A non-streaming answer (or an error answer to a streaming request).

    ``None`` when ``spec.adapter`` wants the request sent again.
    """
    try:
        data = await up.read()
    except UpstreamTimeout as exc:
        backend.record_outcome(False)
        return _fail(router, spec, backend, 504, f"backend {backend.name}: {exc.detail}", started)
    except UpstreamError as exc:
        backend.record_outcome(False)
        return _fail(router, spec, backend, 502, f"backend {backend.name}: {exc.detail}", started)
    finally:
        backend.in_flight -= 1
    status = up.status
    ctype = up.content_type
    if spec.adapter is not None:
        if status != 200 and spec.adapter.retry(backend, status, data):
            backend.record_outcome(True)
            return None
        data = spec.adapter.transform(backend, status, data)
    if status == 200 or "json" in ctype:
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            backend.record_outcome(False)
            return _fail(
                router,
                spec,
                backend,
                502,
                f"backend {backend.name} returned an invalid response (status {status}, "
                f"{len(data)} bytes of {ctype or 'unknown type'})",
                started,
            )
    elif status >= 400:
        # A non-JSON error page (a proxy's HTML, say): keep its status, give a JSON body.
        backend.record_outcome(status < 500)
        return _fail_status(router, spec, backend, status, started)
    if spec.stream and status == 200:
        backend.record_outcome(False)
        return _fail(
            router, spec, backend, 502, f"backend {backend.name} did not stream ({ctype})", started
        )
    backend.record_outcome(status < 500)
    router.metrics.observe(spec.endpoint, backend.name, status, time.perf_counter() - started)
    if status == 200 and spec.store is not None and len(data) <= spec.store_limit:
        spec.store(data, False)
    return Response(
        status,
        data,
        [("content-type", ctype or "application/json"), ("x-continuum-backend", backend.name)],
    )


def _fail_status(
    router: Router, spec: ForwardSpec, backend: Backend, status: int, started: float
) -> Response:
    router.metrics.observe(spec.endpoint, backend.name, status, time.perf_counter() - started)
    return spec.error(status, f"backend {backend.name} answered HTTP {status}", None)


def _relay(
    router: Router, spec: ForwardSpec, backend: Backend, up: UpstreamResponse, started: float
) -> StreamResponse:
    ctype = up.content_type
    if not ctype.startswith(_SSE):
        # Checked before any byte is sent, so the client still gets a proper status.
        up.close()
        backend.in_flight -= 1
        backend.record_outcome(False)
        resp = _fail(
            router, spec, backend, 502, f"backend {backend.name} did not stream ({ctype})", started
        )
        return StreamResponse(resp.status, _once(resp.body), resp.headers)
    router.metrics.observe(spec.endpoint, backend.name, 200, time.perf_counter() - started)
    tee = _Tee(spec.store, spec.store_limit) if spec.store is not None else None
    chunks = up.iter_chunks()
    if spec.adapter is not None:
        chunks = spec.adapter.stream_chunks(backend, chunks)
    return StreamResponse(
        200,
        _Relay(backend, up, tee, chunks),
        [
            ("content-type", ctype),
            ("cache-control", "no-cache"),
            ("x-continuum-backend", backend.name),
        ],
    )


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


class _Tee:
    """Copies a relayed stream, up to a limit, for the response cache."""

    __slots__ = ("limit", "parts", "size", "store")

    def __init__(self, store: Callable[[bytes, bool], None], limit: int) -> None:
        self.store = store
        self.limit = limit
        self.parts: list[bytes] | None = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if self.parts is None:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.parts = None  # oversized: never stored
        else:
            self.parts.append(chunk)

    def complete(self) -> None:
        if self.parts is not None:
            self.store(b"".join(self.parts), True)


class _Relay:
    """Async iterator over upstream chunks whose cleanup runs exactly once.

    A class rather than an async generator: ``aclose()`` on a generator that never
    started skips its ``finally``, which would leak the backend's in-flight count when
    the client disconnects before the first chunk.
    """

    __slots__ = ("_backend", "_chunks", "_done", "_tee", "_up")

    def __init__(
        self,
        backend: Backend,
        up: UpstreamResponse,
        tee: _Tee | None = None,
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        self._backend = backend
        self._up = up
        self._chunks = chunks if chunks is not None else up.iter_chunks()
        self._done = False
        self._tee = tee

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._finish(ok=True)
            if self._tee is not None:
                self._tee.complete()
            raise
        except UpstreamError as exc:
            # Headers are gone already: tell the client in-band, as OpenAI streams do.
            self._finish(ok=False)
            err = {
                "error": {"message": f"backend {exc.backend}: {exc.detail}", "type": "api_error"}
            }
            return b"data: " + orjson.dumps(err) + b"\n\n"
        except asyncio.CancelledError:
            # The server cancels the pump when the client goes away: not the backend's fault.
            self._finish(ok=False, blame=False)
            raise
        except BaseException:
            self._finish(ok=False)
            raise
        if self._tee is not None:
            self._tee.add(chunk)
        return chunk

    async def aclose(self) -> None:
        """The client went away: abort upstream; not the backend's failure."""
        self._finish(ok=False, blame=False)

    def _finish(self, ok: bool, blame: bool = True) -> None:
        if self._done:
            return
        self._done = True
        self._backend.in_flight -= 1
        if ok or blame:
            self._backend.record_outcome(ok)
        if ok:
            self._up.release()
        else:
            self._up.close()
