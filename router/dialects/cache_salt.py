"""The cache-salt step of a chat completion: bind (backend, prefix key) for the listener.

With ``kv_cache_index.salt_secret_file``/``salt_secret_env`` set, a chat completion sent to
a ``type: trtllm`` backend, or to a vllm/sglang backend with ``cache_salt: true``, carries
a ``cache_salt`` made by :func:`bus.salt.encode_salt` over (backend, prefix key, the
caller's own salt). Engines fold the salt into their block hashes and echo it in the first
stored block's KV event, so the listener learns the request's prefix key without
detokenizing. The caller's own ``cache_salt`` (tenant isolation) is kept inside it.

The salt depends on the chosen backend, so it is a per-backend step of the chat dialect's
body (:meth:`router.dialects.openai_chat.ChatCompletions.body`), redone on a retry.
"""

from __future__ import annotations

from typing import Any

import orjson

from bus.salt import encode_salt

from ..pool import Backend

__all__ = ["CacheSalter"]


class CacheSalter:
    """Holds the shared HMAC secret (``kv_cache_index`` is restart-only, so is this)."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @staticmethod
    def applies(backend: Backend) -> bool:
        """TensorRT-LLM always (salts are its only way to the key); others by opt-in."""
        return backend.type == "trtllm" or backend.config.cache_salt

    def salt(self, backend: str, prefix_key: bytes, caller_salt: str | None) -> str:
        return encode_salt(self._secret, backend, prefix_key, caller_salt)

    def salted_body(self, backend: Backend, prefix_key: bytes, parsed: dict[str, Any]) -> bytes:
        """``parsed`` with its ``cache_salt`` bound to ``backend`` (``parsed`` is untouched)."""
        body = dict(parsed)
        body["cache_salt"] = self.salt(backend.name, prefix_key, parsed.get("cache_salt"))
        return orjson.dumps(body)
