"""Forwarding one client request to a selected backend, streaming or not.

A handler (a dialect, ``router.dialects``) turns a client request into a
:class:`ForwardSpec`: plain data about the request. The :class:`Forwarder` selects a
backend, asks the request's :class:`UpstreamFormat` for that backend how to send it (path,
headers, body) and how the answer comes back, sends it, and relays the answer. The format
is the dialect's own for every backend except ``type: gemini`` ones when the request has a
Gemini adapter (``ForwardSpec.gemini``: context cache references, the native API), so the
per-backend choice is made here, once per attempt, by backend type.

Invariants:

* A backend's in-flight count is raised once it is selected and lowered exactly once,
  when its response has been fully sent, failed, or the client went away.
* Only a connect failure is retried, once, on the next candidate: then the engine never
  saw the request, so retrying cannot run a generation twice. The one other retry is the
  format's (``UpstreamFormat.retry``): a Gemini request whose cache reference the backend
  no longer knows was refused before any generation.
* Streams are relayed chunk by chunk as they arrive, never buffered whole. Closing the
  relay (client disconnect) closes the upstream connection, which aborts the engine's
  generation.
* A backend's garbage never reaches the client as a success: it becomes 502 naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson

from .forward_spec import CacheWrite, ForwardSpec, RoutingFeedback, UpstreamFormat, headers_for
from .http.types import Response, StreamResponse
from .metrics import RouterMetrics
from .pool import Backend, BackendPool
from .selection import Selector
from .upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)

__all__ = ["Forwarder", "openai_usage"]

_SSE = "text/event-stream"


class Forwarder:
    """Sends prepared requests to selected backends and relays their answers.

    Args:
        selector: picks a backend among the candidates.
        client: the upstream HTTP client.
        pool: told about connect failures (passive health).
        metrics: request counts and latencies, retries.
        feedback: told what each request cost and what the engine reused, for requests
            the selector assessed by their prompt chain (conversation-depth routing).
    """

    def __init__(
        self,
        selector: Selector,
        client: UpstreamClient,
        pool: BackendPool,
        metrics: RouterMetrics,
        feedback: RoutingFeedback | None = None,
    ) -> None:
        self._selector = selector
        self._client = client
        self._pool = pool
        self._metrics = metrics
        self._feedback = feedback

    async def forward(
        self, spec: ForwardSpec, candidates: Sequence[Backend], mask: int, started: float
    ) -> Response | StreamResponse:
        attempts = 0
        while True:
            backend = await self._selector.select(candidates, mask, spec.ctx)
            fmt = spec.format_for(backend)
            body = fmt.body(backend, spec)
            feedback = self._feedback if spec.ctx.view is not None else None
            ticket = feedback.sent(backend, spec.ctx) if feedback is not None else None
            backend.in_flight += 1
            t0 = time.perf_counter()
            try:
                up = await self._client.request(
                    backend.name,
                    "POST",
                    backend.url + fmt.path(backend),
                    fmt.headers(backend, headers_for(backend, spec.forwarded)),
                    body,
                )
            except UpstreamConnectError as exc:
                backend.in_flight -= 1
                backend.record_outcome(False)
                self._pool.connect_failed(backend)
                attempts += 1
                rest = tuple(c for c in candidates if c is not backend)
                if attempts == 1 and rest:
                    self._metrics.retry(backend.name)
                    candidates = rest
                    mask &= ~(1 << backend.index)
                    continue
                return self._fail(spec, backend, 502, exc.detail, started)
            except UpstreamTimeout as exc:
                backend.in_flight -= 1
                backend.record_outcome(False)
                return self._fail(spec, backend, 504, exc.detail, started)
            except UpstreamError as exc:
                backend.in_flight -= 1
                backend.record_outcome(False)
                return self._fail(spec, backend, 502, exc.detail, started)
            except BaseException:
                backend.in_flight -= 1
                raise
            finally:
                if feedback is not None:
                    feedback.answered(ticket)
            self._pool.connect_succeeded(backend)
            backend.record_latency(time.perf_counter() - t0)
            if spec.stream and up.status == 200:
                return self._relay(spec, fmt, backend, up, started, feedback)
            resp = await self._whole(spec, fmt, backend, up, started, feedback)
            if resp is not None:
                return resp
            # The format asked for one more attempt (a Gemini cache reference had expired).

    def _fail(
        self, spec: ForwardSpec, backend: Backend, status: int, detail: str, started: float
    ) -> Response:
        """A failure the router reports (502, 504) with a message naming the backend."""
        return self._error(spec, backend, status, f"backend {backend.name}: {detail}", started)

    def _error(
        self, spec: ForwardSpec, backend: Backend, status: int, msg: str, started: float
    ) -> Response:
        self._metrics.observe(spec.endpoint, backend.name, status, time.perf_counter() - started)
        code = "upstream_timeout" if status == 504 else "bad_gateway"
        return spec.error(status, msg, code)

    async def _whole(
        self,
        spec: ForwardSpec,
        fmt: UpstreamFormat,
        backend: Backend,
        up: UpstreamResponse,
        started: float,
        feedback: RoutingFeedback | None,
    ) -> Response | None:
        """A non-streaming answer (or an error answer to a streaming request).

        ``None`` when the format wants the request sent again.
        """
        try:
            data = await up.read()
        except UpstreamTimeout as exc:
            backend.record_outcome(False)
            return self._fail(spec, backend, 504, exc.detail, started)
        except UpstreamError as exc:
            backend.record_outcome(False)
            return self._fail(spec, backend, 502, exc.detail, started)
        finally:
            backend.in_flight -= 1
        status = up.status
        ctype = up.content_type
        doc: Any = None
        if status != 200 and fmt.retry(backend, status, data):
            backend.record_outcome(True)
            return None
        data = fmt.transform(backend, status, data)
        if status == 200 or "json" in ctype:
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                backend.record_outcome(False)
                return self._error(
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
            self._metrics.observe(
                spec.endpoint, backend.name, status, time.perf_counter() - started
            )
            return spec.error(status, f"backend {backend.name} answered HTTP {status}", None)
        if spec.stream and status == 200:
            backend.record_outcome(False)
            return self._error(
                spec, backend, 502, f"backend {backend.name} did not stream ({ctype})", started
            )
        backend.record_outcome(status < 500)
        self._metrics.observe(spec.endpoint, backend.name, status, time.perf_counter() - started)
        if feedback is not None and status == 200 and type(doc) is dict:
            usage = openai_usage(doc)
            if usage is not None:
                feedback.delivered(backend, spec.ctx, usage)
        if status == 200 and spec.store is not None and len(data) <= spec.store_limit:
            spec.store(data, False)
        return Response(
            status,
            data,
            [("content-type", ctype or "application/json"), ("x-continuum-backend", backend.name)],
        )

    def _relay(
        self,
        spec: ForwardSpec,
        fmt: UpstreamFormat,
        backend: Backend,
        up: UpstreamResponse,
        started: float,
        feedback: RoutingFeedback | None,
    ) -> StreamResponse:
        ctype = up.content_type
        if not ctype.startswith(_SSE):
            # Checked before any byte is sent, so the client still gets a proper status.
            up.close()
            backend.in_flight -= 1
            backend.record_outcome(False)
            resp = self._error(
                spec, backend, 502, f"backend {backend.name} did not stream ({ctype})", started
            )
            return StreamResponse(resp.status, _once(resp.body), resp.headers)
        self._metrics.observe(spec.endpoint, backend.name, 200, time.perf_counter() - started)
        tee = _Tee(spec.store, spec.store_limit) if spec.store is not None else None
        chunks = fmt.stream(backend, up.iter_chunks())
        if feedback is not None:
            chunks = _usage_of(chunks, lambda usage: feedback.delivered(backend, spec.ctx, usage))
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


def openai_usage(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The usage of an answer (or stream event) in chat completions' shape, or None.

    Chat and text completions carry ``usage`` with ``prompt_tokens_details``; the Responses
    API carries it as ``usage`` (a whole response) or ``response.usage`` (its
    ``response.completed`` event) with ``input_tokens`` and ``input_tokens_details``,
    which are renamed here so the routing feedback reads one shape.
    """
    usage = doc.get("usage")
    if type(usage) is not dict:
        inner = doc.get("response")
        usage = inner.get("usage") if type(inner) is dict else None
        if type(usage) is not dict:
            return None
    if "input_tokens_details" in usage and "prompt_tokens_details" not in usage:
        return {
            "prompt_tokens": usage.get("input_tokens"),
            "prompt_tokens_details": usage["input_tokens_details"],
        }
    return usage


async def _usage_of(
    chunks: AsyncIterator[bytes], sink: Callable[[dict[str, Any]], None]
) -> AsyncIterator[bytes]:
    """``chunks`` unchanged; the ``usage`` of the stream's usage chunk (OpenAI sends it
    last, with ``stream_options.include_usage``; the Responses API in its
    ``response.completed`` event) goes to ``sink``. Only a chunk that mentions ``"usage"``
    is parsed; an event split across chunks is joined first."""
    pending = b""
    async for chunk in chunks:
        yield chunk
        if pending or b'"usage"' in chunk:
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if b'"usage"' not in event:
                    continue
                at = 0 if event.startswith(b"data: {") else event.find(b"\ndata: {") + 1
                if at == 0 and not event.startswith(b"data: {"):
                    continue
                try:
                    doc = orjson.loads(event[at + 6 :])
                except orjson.JSONDecodeError:
                    continue
                usage = openai_usage(doc) if type(doc) is dict else None
                if usage is not None:
                    sink(usage)
            if len(pending) > 1 << 20:
                pending = b""


class _Tee:
    """Copies a relayed stream, up to a limit, for the response cache."""

    __slots__ = ("limit", "parts", "size", "store")

    def __init__(self, store: CacheWrite, limit: int) -> None:
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
        tee: _Tee | None,
        chunks: AsyncIterator[bytes],
    ) -> None:
        self._backend = backend
        self._up = up
        self._chunks = chunks
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
