"""The prefix key: the single source of truth for how a request's anchor text is hashed.

Router (Tier 1 ring, Tier 4 index lookups), listener (recovering keys from engine block
chains) and the Gemini context cache all name a prompt prefix by this digest, so it must
be computed in exactly one place::

    SHA256(model_bytes ++ 0x00 ++ b"S" ++ system_bytes[:n])      # a system prompt exists
    SHA256(model_bytes ++ 0x00 ++ b"M" ++ first_msg_bytes[:n])   # otherwise: first message
    SHA256(model_bytes ++ 0x00 ++ b"P" ++ prompt_bytes[:n])      # a text completion's prompt

* ``n`` is ``max_prefix_length`` bytes, cut back to a UTF-8 code point boundary so a
  multi-byte character is never split (``None`` disables the cut: the Gemini cache
  hashes the whole system prompt).
* The 0x00 separator stops ``("ab", "c...")`` and ``("a", "bc...")`` from colliding.
* The ``S``/``M`` tag keeps the same text in a system prompt and in a first user message
  apart: the engine renders them differently, so their KV blocks differ. ``P`` is the
  leading text of a ``/v1/completions`` prompt, which the engine tokenizes as it is (no
  chat template), so it is kept apart from both.

Content given as an array of parts (OpenAI content parts, Anthropic blocks) contributes
its text parts joined with ``"\\n"``: that is how vLLM and SGLang flatten text parts
before applying the chat template, so the listener, which only sees the rendered tokens,
recovers the same bytes. Non-text parts (images, audio, tool results) are skipped.

On the wire the key is the lowercase hex of the 32-byte digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NewType

__all__ = [
    "DEFAULT_MAX_PREFIX_LENGTH",
    "PrefixKey",
    "PrefixTag",
    "anchor_text",
    "compute_prefix_key",
    "extract_prefix_key",
    "truncate_utf8",
]

PrefixKey = NewType("PrefixKey", bytes)
"""A 32-byte SHA-256 digest naming a prompt prefix; never an engine block hash."""

DEFAULT_MAX_PREFIX_LENGTH = 1024

_SYSTEM_ROLES = frozenset(("system", "developer"))
_TAG_BYTES = {"S": b"\x00S", "M": b"\x00M", "P": b"\x00P"}
PrefixTag = Literal["S", "M", "P"]
"""System prompt, first message, raw completion prompt."""


def truncate_utf8(data: bytes, limit: int | None) -> bytes:
    """Cut ``data`` to at most ``limit`` bytes without splitting a UTF-8 code point."""
    if limit is None or len(data) <= limit:
        return data
    cut = limit
    # Step back over continuation bytes (0b10xxxxxx) to the start of the code point.
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut]


def compute_prefix_key(
    model: str, tag: PrefixTag, text: str, max_prefix_length: int | None
) -> PrefixKey:
    """Hash already-located anchor text; the listener and Gemini cache call this directly."""
    if max_prefix_length is not None and len(text) > max_prefix_length:
        # Every code point is at least one byte, so the first n code points hold the
        # first n bytes: encode only those instead of a possibly huge prompt.
        text = text[:max_prefix_length]
    data = truncate_utf8(text.encode("utf-8", "surrogatepass"), max_prefix_length)
    h = hashlib.sha256(model.encode("utf-8", "surrogatepass"))
    h.update(_TAG_BYTES[tag])
    h.update(data)
    return PrefixKey(h.digest())


def _content_text(content: Any) -> str:
    """Text of a message's content: a string, or the text parts of a part array."""
    if type(content) is str:
        return content
    if isinstance(content, str):
        return content
    if type(content) is list or (
        isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray))
    ):
        texts = [
            part["text"]
            for part in content
            if (type(part) is dict or isinstance(part, Mapping))
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ]
        return "\n".join(texts)
    return ""


def anchor_text(body: Mapping[str, Any]) -> tuple[Literal["S", "M"], str] | None:
    """Locate the anchor of an OpenAI or Anthropic request body.

    Returns the tag and text, or ``None`` when there is no text to anchor on. The
    Anthropic top-level ``system`` (string or blocks) wins; then an OpenAI
    ``system``/``developer`` message that comes before any other non-empty message; else
    the first non-empty message. A system message after the first user turn is rendered
    after it, so the engine's chain (all the listener sees) starts with the user turn:
    the key must too.
    """
    system = body.get("system")
    if system is not None:
        text = _content_text(system)
        if text:
            return "S", text
    messages = body.get("messages")
    if type(messages) is not list and (
        not isinstance(messages, Sequence) or isinstance(messages, (str, bytes))
    ):
        return None
    for msg in messages:
        if type(msg) is not dict and not isinstance(msg, Mapping):
            continue
        text = _content_text(msg.get("content"))
        if text:
            return ("S" if msg.get("role") in _SYSTEM_ROLES else "M"), text
    return None


def extract_prefix_key(
    body: Mapping[str, Any],
    *,
    enabled: bool = True,
    max_prefix_length: int | None = DEFAULT_MAX_PREFIX_LENGTH,
    model: str | None = None,
) -> PrefixKey | None:
    """The request's prefix key, or ``None`` when prefix routing is off or there is no text.

    ``model`` defaults to the body's ``model`` field; a body without a string model has
    no key (the router rejects such requests before routing anyway).
    """
    if not enabled:
        return None
    if model is None:
        model = body.get("model")
        if not isinstance(model, str):
            return None
    anchor = anchor_text(body)
    if anchor is None:
        return None
    tag, text = anchor
    return compute_prefix_key(model, tag, text, max_prefix_length)
