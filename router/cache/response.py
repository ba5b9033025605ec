"""Tier 2: the response cache in the request path (eligibility, key, hit, store).

Cache key, exactly the reference design (each field separated by a 0x00 byte)::

    SHA256( model
          ‖ SHA256(messages)            messages as canonical JSON (sorted keys, compact)
          ‖ temperature                 f64 little-endian (absent = 0.0)
          ‖ tag ‖ max_tokens            tag 0x01 + u64 LE, or tag 0x00 when absent
          ‖ tag ‖ top_p                 tag 0x01 + f64 LE, or 0x00
          ‖ tag ‖ tenant_id )           tag 0x01 + UTF-8, or 0x00

The SOME/NONE tags keep ``None`` and ``Some(0)`` apart. The tenant is the
authenticated caller (a digest of its bearer token), so tenants never share entries.

Eligibility: temperature 0 or absent, and nothing in the request that shapes the output
but is not in the key (tools, response_format, stop, seed, n > 1, logprobs, ...): such a
request is BYPASSed rather than risk answering it with another request's output.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson

from ..http.types import Headers

__all__ = ["UNKEYED_FIELDS", "cache_key", "ineligible_reason", "replay_sse", "tenant_of"]

UNKEYED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "cache_salt",
)
"""Output-shaping request fields the key does not cover: their presence bypasses."""

_NONE = b"\x00"
_SOME = b"\x01"
_SEP = b"\x00"


def tenant_of(headers: Headers) -> str | None:
    """The caller's tenant: a digest of its bearer token (never the token itself)."""
    auth = headers.get("authorization") or headers.get("x-api-key") or ""
    token = auth.partition(" ")[2] if auth.lower().startswith("bearer ") else auth
    token = token.strip()
    if not token:
        return None
    return hashlib.sha256(b"continuum-tenant\x00" + token.encode()).hexdigest()[:32]


def ineligible_reason(body: Mapping[str, Any]) -> str | None:
    """Why a request cannot be served from or stored in the cache, or None."""
    t = body.get("temperature")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or t != 0):
        return "temperature"
    n = body.get("n")
    if n is not None and n != 1:
        return "n"
    for field in UNKEYED_FIELDS:
        if body.get(field) not in (None, False):
            return field
    return None


def cache_key(body: Mapping[str, Any], tenant: str | None) -> str:
    """The hex cache key of an eligible chat completion request."""
    model = body.get("model")
    messages = orjson.dumps(body.get("messages"), option=orjson.OPT_SORT_KEYS)
    h = hashlib.sha256(str(model).encode("utf-8", "surrogatepass"))
    h.update(_SEP)
    h.update(hashlib.sha256(messages).digest())
    h.update(_SEP)
    h.update(struct.pack("<d", float(body.get("temperature") or 0.0)))
    h.update(_SEP)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 0:
        h.update(_SOME + struct.pack("<Q", min(max_tokens, (1 << 64) - 1)))
    else:
        h.update(_NONE)
    h.update(_SEP)
    top_p = body.get("top_p")
    if isinstance(top_p, (int, float)) and not isinstance(top_p, bool):
        h.update(_SOME + struct.pack("<d", float(top_p)))
    else:
        h.update(_NONE)
    h.update(_SEP)
    h.update(_SOME + tenant.encode() if tenant is not None else _NONE)
    return h.hexdigest()


async def replay_sse(blob: bytes) -> AsyncIterator[bytes]:
    """A stored stream, sent back record by record as a synthetic SSE stream."""
    start = 0
    n = len(blob)
    while start < n:
        end = blob.find(b"\n\n", start)
        end = n if end < 0 else end + 2
        yield blob[start:end]
        start = end
