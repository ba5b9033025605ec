"""Which conversation a chat request belongs to, without a session id.

The chain keys say which prompt text a request shares with what engines hold, not whose
conversation it is: sessions that share a system prompt or a tool suite and open with a
short message have the same keys up to their last full chunk (``bench/fleet_bench.py``
(b): every agent session's first request ended inside its suite's 15 shared chunks, so
each new session looked like the next turn of the previous one). A conversation resends
its whole history every turn, so its first user message, with everything before it, is
the same in every request of it and differs between sessions: its digest is the
conversation's identity. Two sessions that open with the same words under the same
system prompt are one conversation here, which only makes the resident term count one
history where there are two.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from xxhash import xxh3_128_digest

__all__ = ["conversation_id"]


def conversation_id(body: Mapping[str, Any], root: bytes) -> bytes | None:
    """The 16-byte identity of ``body``'s conversation under the chain ``root``: the
    digest of its messages up to and including the first ``user`` one, or None when it
    has none (or they do not serialize)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            try:
                data = orjson.dumps(messages[: i + 1])
            except TypeError:
                return None
            return xxh3_128_digest(root + data)
    return None
