"""Wire details of Google's Generative Language API that the router depends on.

Paths are appended to the backend's ``url`` (``https://generativelanguage.googleapis.com``):

* ``POST /v1beta/openai/chat/completions`` — the OpenAI-compatible endpoint; a cache is
  referenced with ``"extra_body": {"google": {"cached_content": "cachedContents/…"}}`` in
  the JSON body (the outer ``extra_body`` is a literal key on the wire);
* ``POST /v1beta/models/{model}:generateContent`` and
  ``POST /v1beta/models/{model}:streamGenerateContent?alt=sse`` — the native API; a cache
  is referenced with the top-level ``cachedContent`` field, and ``systemInstruction``,
  ``tools`` and ``toolConfig`` must then be absent (they live in the cache);
* ``POST /v1beta/cachedContents`` (create: ``model``, ``systemInstruction``, ``ttl`` as a
  ``"600s"`` duration string; the answer carries ``name``, ``expireTime`` (RFC 3339) and
  ``usageMetadata.totalTokenCount``), ``PATCH /v1beta/cachedContents/{id}?updateMask=ttl``
  (only the expiration is updatable), ``DELETE /v1beta/cachedContents/{id}``.

The native API and the cache service authenticate with ``x-goog-api-key``; the
OpenAI-compatible endpoint takes the same key as a bearer token.
"""

from __future__ import annotations

import re
from datetime import datetime

import orjson

__all__ = [
    "CACHED_CONTENTS_PATH",
    "OPENAI_CHAT_PATH",
    "OPENAI_EMBEDDINGS_PATH",
    "CachedContent",
    "error_message",
    "generate_path",
    "is_stale_reference",
    "model_id",
    "model_resource",
    "native_headers",
    "parse_cached_content",
    "parse_timestamp",
    "resource_path",
    "ttl_string",
]

OPENAI_CHAT_PATH = "/v1beta/openai/chat/completions"
OPENAI_EMBEDDINGS_PATH = "/v1beta/openai/embeddings"
CACHED_CONTENTS_PATH = "/v1beta/cachedContents"
_NAME_RE = re.compile(r"^cachedContents/[A-Za-z0-9_.-]{1,128}\Z")
_TS_RE = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})\Z")


def model_id(model: str) -> str:
    """``gemini-2.5-flash`` for ``gemini-2.5-flash`` or ``models/gemini-2.5-flash``."""
    return model.removeprefix("models/")


def model_resource(model: str) -> str:
    """``models/gemini-2.5-flash``: the form cachedContents.model requires."""
    return "models/" + model_id(model)


def generate_path(model: str, stream: bool) -> str:
    mid = model_id(model)
    if stream:
        return f"/v1beta/models/{mid}:streamGenerateContent?alt=sse"
    return f"/v1beta/models/{mid}:generateContent"


def resource_path(name: str) -> str:
    """``/v1beta/cachedContents/{id}`` for a resource name the router recorded."""
    return "/v1beta/" + name


def native_headers(api_key: str | None) -> dict[str, str]:
    h = {"content-type": "application/json", "accept-encoding": "identity"}
    if api_key:
        h["x-goog-api-key"] = api_key
    return h


def ttl_string(seconds: float) -> str:
    """A protobuf Duration in its JSON form: ``"600s"``."""
    return f"{int(seconds)}s"


def parse_timestamp(value: str) -> float:
    """RFC 3339 (``2026-01-01T00:10:00.123456789Z``) to POSIX seconds; ValueError if not."""
    m = _TS_RE.match(value)
    if m is None:
        raise ValueError(f"not an RFC 3339 timestamp: {value!r}")
    base, frac, zone = m.groups()
    dt = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return dt.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


class CachedContent:
    """The fields of a CachedContent answer the router keeps."""

    __slots__ = ("expire_time", "name", "token_count")

    def __init__(self, name: str, expire_time: float | None, token_count: int) -> None:
        self.name = name
        self.expire_time = expire_time
        """POSIX seconds, or ``None`` when the answer had no usable ``expireTime``."""
        self.token_count = token_count


def parse_cached_content(data: bytes) -> CachedContent:
    """Parse a create/patch answer; ValueError when it is not a CachedContent."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"no valid cachedContents name: {name!r}")
    expire: float | None = None
    raw = doc.get("expireTime")
    if isinstance(raw, str):
        try:
            expire = parse_timestamp(raw)
        except ValueError:
            expire = None
    tokens = 0
    usage = doc.get("usageMetadata")
    if isinstance(usage, dict):
        count = usage.get("totalTokenCount")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            tokens = count
    return CachedContent(name, expire, tokens)


def error_message(data: bytes) -> str:
    """The ``error.message`` of a Google error body (also the list form), else ''."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ""
    if isinstance(doc, list) and doc:
        doc = doc[0]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
    return ""


def is_stale_reference(status: int, data: bytes) -> bool:
    """Whether an error answer says the referenced cachedContents resource is gone.

    Google answers 404 for an unknown resource; a generate call naming an expired or
    deleted cache may also come back as 403 "CachedContent not found (or permission
    denied)". Any other error is the request's own.
    """
    if status == 404:
        return True
    if status == 403:
        msg = error_message(data).lower()
        return "cachedcontent" in msg or "cached content" in msg
    return False
