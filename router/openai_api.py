"""Where each backend type serves OpenAI's API, and the headers that reach it.

One home for what the chat and embeddings dialects and the semantic cache's embedding
call all need: ``type: gemini`` backends serve it under Google's OpenAI-compatible prefix,
every other type at ``/v1``; requests are JSON, uncompressed (the router relays bytes), and
carry the backend's own key as a bearer token, never the client's.
"""

from __future__ import annotations

from collections.abc import Mapping

from .gemini.api import OPENAI_CHAT_PATH, OPENAI_EMBEDDINGS_PATH
from .pool import Backend

__all__ = ["bearer_headers", "chat_path", "embeddings_path"]


def chat_path(backend: Backend) -> str:
    return OPENAI_CHAT_PATH if backend.type == "gemini" else "/v1/chat/completions"


def embeddings_path(backend: Backend) -> str:
    return OPENAI_EMBEDDINGS_PATH if backend.type == "gemini" else "/v1/embeddings"


def bearer_headers(backend: Backend, forwarded: Mapping[str, str] = {}) -> dict[str, str]:
    """``forwarded`` (the client's end-to-end headers) plus JSON, identity, the bearer key."""
    h = dict(forwarded)
    h["content-type"] = "application/json"
    h["accept-encoding"] = "identity"
    if backend.api_key:
        h["authorization"] = f"Bearer {backend.api_key}"
    return h
