"""Requests towards ``type: gemini`` backends: one adapter object per request.

``GeminiService`` lives as long as the router (it exists only when the context cache or
the native API is configured); ``GeminiChat`` is made per request by the chat and
messages dialects, and the forwarder uses it as the request's
:class:`~router.forwarder.UpstreamFormat` for gemini backends only (other backends of the
same model keep the dialect's own format): the path, headers and body for the chosen
backend, the whole-body and stream transforms, and the one retry after a stale cache
reference. On the OpenAI-compatible path (no native API) its path and headers are the
dialect's (``base``). The same adapter serves Anthropic Messages bodies
(``dialect="anthropic"``), which always use the native API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Literal

import orjson

from ..config import GeminiContextCacheConfig
from ..forward_spec import ForwardSpec, UpstreamFormat
from ..pool import Backend
from ..upstream import UpstreamClient
from . import anthropic
from .api import generate_path, is_stale_reference, native_headers
from .entries import CacheEntry
from .manager import Eligible, GeminiContextCache, eligible_anthropic_prefix, eligible_prefix
from .native import NativeStream, TranslationError, chat_completion, openai_error_body
from .native import to_generate_request as _to_native
from .usage import UsageRecord, cached_tokens_of, fill_cached_tokens, openai_usage

__all__ = ["GeminiChat", "GeminiService", "TranslationError"]

UsageSink = Callable[[UsageRecord], None]
Dialect = Literal["openai", "anthropic"]
_ANTHROPIC_HEADERS = frozenset(
    ("x-api-key", "anthropic-version", "anthropic-beta", "authorization")
)
_MAX_PENDING = 1 << 20
"""Bytes of an unfinished SSE event held back while looking for the usage chunk."""


class GeminiService:
    """The router-wide part: the context cache (when enabled) and the usage sink."""

    def __init__(
        self,
        config: GeminiContextCacheConfig,
        client: UpstreamClient,
        on_usage: UsageSink | None = None,
    ) -> None:
        self.config = config
        self.cache = GeminiContextCache(config, client) if config.enabled else None
        self.on_usage = on_usage

    def chat(
        self,
        body: dict[str, Any],
        model: str,
        stream: bool,
        base: UpstreamFormat,
        dialect: Dialect = "openai",
    ) -> GeminiChat:
        """Per-request state; raises TranslationError when the native form is impossible.

        ``base`` is the dialect's own format (its path and headers serve the
        OpenAI-compatible path); ``dialect="anthropic"`` is an Anthropic Messages body,
        always sent natively.
        """
        return GeminiChat(self, body, model, stream, base, dialect)

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()


class GeminiChat:
    """The upstream format of one request for gemini backends; see the module docstring."""

    def __init__(
        self,
        service: GeminiService,
        body: dict[str, Any],
        model: str,
        stream: bool,
        base: UpstreamFormat,
        dialect: Dialect = "openai",
    ):
        self.service = service
        self.base = base
        self.model = model
        self.streaming = stream
        self.anthropic = dialect == "anthropic"
        self.native = self.anthropic or service.config.prefer_native_api
        cache = service.cache
        self.prefix: Eligible | None = None
        if cache is not None:
            find = eligible_anthropic_prefix if self.anthropic else eligible_prefix
            self.prefix = find(body, model, service.config.min_prefix_bytes)
        self._used: dict[str, CacheEntry] = {}
        self._planned: set[str] = set()
        self._retried = False
        self._native_plain: bytes | None = None
        if self.native:
            self._native_plain = orjson.dumps(self._translate(body, None))  # validates
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and opts.get("include_usage") is True

    # -- request side ------------------------------------------------------------------

    def path(self, b: Backend) -> str:
        return generate_path(self.model, self.streaming) if self.native else self.base.path(b)

    def headers(self, b: Backend, forwarded: Mapping[str, str]) -> dict[str, str]:
        if not self.native:
            return self.base.headers(b, forwarded)
        drop = _ANTHROPIC_HEADERS if self.anthropic else ("authorization",)
        h = {k: v for k, v in forwarded.items() if k not in drop}
        h.update(native_headers(b.api_key))
        return h

    def _translate(self, body: Mapping[str, Any], cached: str | None) -> dict[str, Any]:
        if self.anthropic:
            return anthropic.to_generate_request(body, cached_content=cached)
        return _to_native(body, cached_content=cached)

    def body(self, b: Backend, spec: ForwardSpec) -> bytes:
        """The body for ``b``: with a live cache reference when there is one."""
        parsed = spec.parsed
        entry = self._entry_for(b)
        if entry is None:
            self._used.pop(b.name, None)
            return self._native_plain if self._native_plain is not None else spec.body
        self._used[b.name] = entry
        assert entry.name is not None
        if self.native:
            return orjson.dumps(self._translate(parsed, entry.name))
        body = dict(parsed)
        body["messages"] = parsed["messages"][1:]  # the system prompt lives in the cache
        extra = body.get("extra_body")
        extra = dict(extra) if isinstance(extra, dict) else {}
        google = extra.get("google")
        google = dict(google) if isinstance(google, dict) else {}
        google["cached_content"] = entry.name
        extra["google"] = google
        body["extra_body"] = extra
        return orjson.dumps(body)

    def _entry_for(self, b: Backend) -> CacheEntry | None:
        cache = self.service.cache
        if cache is None:
            return None
        first = b.name not in self._planned
        self._planned.add(b.name)
        if self.prefix is None:
            if first:
                cache.ineligible(b)
            return None
        if self._retried and not first:
            return None  # the retry after a stale reference goes without one
        return cache.plan(b, self.prefix)

    # -- response side -----------------------------------------------------------------

    def retry(self, b: Backend, status: int, data: bytes) -> bool:
        """Whether to send the request again (once) because its cache reference is gone."""
        entry = self._used.pop(b.name, None)
        cache = self.service.cache
        if entry is None or cache is None or self._retried or entry.name is None:
            return False
        if not is_stale_reference(status, data):
            return False
        self._retried = True
        cache.stale(b.name, entry.digest, entry.name)
        return True

    def transform(self, b: Backend, status: int, data: bytes) -> bytes:
        """A whole answer from ``b`` as the client should see it."""
        if self.native:
            if status != 200:
                if self.anthropic:
                    return anthropic.anthropic_error_body(status, data)
                return openai_error_body(status, data)
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                return data  # the proxy turns it into a 502
            if not isinstance(doc, dict):
                return data
            if self.anthropic:
                meta = doc.get("usageMetadata")
                self._account(b, openai_usage(meta if isinstance(meta, dict) else {}))
                return orjson.dumps(anthropic.message_response(doc, self.model))
            out = chat_completion(doc, self.model)
            self._account(b, out["usage"])
            return orjson.dumps(out)
        if status != 200:
            return data
        entry = self._used.get(b.name)
        if entry is None and self.service.cache is None and self.service.on_usage is None:
            return data
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return data
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if not isinstance(usage, dict):
            return data
        if entry is not None:
            fill_cached_tokens(usage, entry.token_count)
        self._account(b, usage)
        return orjson.dumps(doc) if entry is not None else data

    def stream(self, b: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        if self.native:
            return self._native_stream(b, chunks)
        return self._compat_stream(b, chunks)

    async def _native_stream(
        self, b: Backend, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        conv: NativeStream | anthropic.AnthropicStream
        if self.anthropic:
            conv = anthropic.AnthropicStream(self.model, lambda u: self._account(b, u))
        else:
            conv = NativeStream(self.model, self.include_usage, lambda u: self._account(b, u))
        async for chunk in chunks:
            out = conv.feed(chunk)
            if out:
                yield out
        tail = conv.finish()
        if tail:
            yield tail

    async def _compat_stream(
        self, b: Backend, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """Relays SSE as is, except the usage chunk, which gets ``cached_tokens``."""
        entry = self._used.get(b.name)
        buf = b""
        async for chunk in chunks:
            buf += chunk
            cut = _last_boundary(buf)
            if cut == 0:
                if len(buf) > _MAX_PENDING:  # no event boundary in sight: relay as is
                    yield buf
                    buf = b""
                continue
            head, buf = buf[:cut], buf[cut:]
            yield self._patch_events(b, head, entry) if b'"usage"' in head else head
        if buf:
            yield self._patch_events(b, buf, entry) if b'"usage"' in buf else buf

    def _patch_events(self, b: Backend, data: bytes, entry: CacheEntry | None) -> bytes:
        out = []
        for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
            if not event.strip():
                continue
            if b'"usage"' in event and event.startswith(b"data: {"):
                try:
                    doc = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    doc = None
                usage = doc.get("usage") if isinstance(doc, dict) else None
                if isinstance(usage, dict):
                    if entry is not None:
                        fill_cached_tokens(usage, entry.token_count)
                    self._account(b, usage)
                    event = b"data: " + orjson.dumps(doc)
            out.append(event + b"\n\n")
        return b"".join(out)

    def _account(self, b: Backend, usage: Mapping[str, Any]) -> None:
        cache = self.service.cache
        if cache is not None:
            cache.served_cached(b.name, cached_tokens_of(usage))
        sink = self.service.on_usage
        if sink is not None:
            sink(UsageRecord.from_openai(b.name, self.model, usage))


def _last_boundary(buf: bytes) -> int:
    """Length of the prefix of ``buf`` made of complete SSE events (0 when none)."""
    i = buf.rfind(b"\n\n")
    j = buf.rfind(b"\r\n\r\n")
    if i < 0 and j < 0:
        return 0
    return max(i + 2 if i >= 0 else 0, j + 4 if j >= 0 else 0)
