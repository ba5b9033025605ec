"""The render cache: a conversation's chain state after a prefix of its messages, so the
next turn renders and hashes only the messages it adds (:mod:`.incremental`).

Keyed by the template's plan, the chain's root and a digest of the raw messages up to a
boundary: a rolling XXH3-128 over each message (a ``{"role", "content"}`` pair of strings
by its two strings, any other message by its ``orjson`` serialization, each framed by its
length), so turn k+1 finds turn k's state by the digest of its own first messages. An
entry holds what reuse must check (the text before the loop, the loop-start values) and
the chain state (last key, partial chunk, length) and keys so far; entries are evicted
least recently used past ``max_bytes`` (their approximate size in memory).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from bus.prompt_chain import ChainKey, ChainState

__all__ = ["CacheEntry", "RenderCache", "message_digests"]

_ENTRY_OVERHEAD = 400
"""Bytes an entry costs beyond its strings and keys (the entry, its tuple, the dict slot)."""


def message_digests(messages: Sequence[Any]) -> list[bytes] | None:
    """The digest of ``messages[:j]`` for every ``j`` from 1; None when a message is not
    JSON-serializable (then nothing is cached)."""
    h = xxhash.xxh3_128()
    update, digest = h.update, h.digest
    out: list[bytes] = []
    append = out.append
    try:
        for m in messages:
            if (
                type(m) is dict
                and len(m) == 2
                and type(role := m.get("role")) is str
                and type(content := m.get("content")) is str
            ):
                r, c = role.encode(), content.encode()
                update(b"s%d:%d:" % (len(r), len(c)))
                update(r)
                update(c)
            else:
                data = orjson.dumps(m)
                update(b"j%d:" % len(data))
                update(data)
            append(digest())
    except (TypeError, UnicodeEncodeError, orjson.JSONEncodeError):
        return None
    return out


@dataclass(frozen=True, slots=True)
class CacheEntry:
    head: str
    """The text the template outputs before its message loop."""
    values: tuple[Any, ...]
    """The loop-start values (the plan's snapshot names, then its guards' values)."""
    state: ChainState
    keys: tuple[ChainKey, ...]
    nbytes: int


def entry_size(head: str, state: ChainState, keys: int, values: tuple[Any, ...]) -> int:
    size = _ENTRY_OVERHEAD + len(head) + len(state.partial) + 16 * keys
    for v in values:
        if type(v) is str:
            size += len(v)
        elif isinstance(v, list | dict):
            size += len(orjson.dumps(v, default=repr))
    return size


class RenderCache:
    """A bytes-bounded LRU of :class:`CacheEntry` (one event loop: no locking)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Any, ...], CacheEntry] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

    def find(self, prefix: tuple[Any, ...], digests: Sequence[bytes], probes: int) -> int:
        """The longest ``j`` < ``len(digests)`` (at most ``probes`` tried) with an entry for
        ``digests[:j]``, or 0."""
        entries = self._entries
        stop = max(0, len(digests) - 1 - probes)
        for j in range(len(digests) - 1, stop, -1):
            if (*prefix, digests[j - 1]) in entries:
                return j
        return 0

    def get(self, key: tuple[Any, ...]) -> CacheEntry:
        entry = self._entries[key]
        self._entries.move_to_end(key)
        return entry

    def put(self, key: tuple[Any, ...], entry: CacheEntry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        if entry.nbytes > self.max_bytes:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self._bytes -= gone.nbytes
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
