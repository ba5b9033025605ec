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

__all__ = ["CacheEntry", "MessageDigests", "RenderCache", "entry_size"]

_ENTRY_OVERHEAD = 400
"""Bytes an entry costs beyond its strings and keys (the entry, its tuple, the dict slot)."""


class MessageDigests:
    """Digests of a request's first ``j`` messages, for the ``j`` the cache asks about.

    The messages are serialized once (``orjson``: ``[m0,m1,...]``, each message as its
    own ``orjson.dumps`` and nothing between them but a comma), and the digest of the
    first ``j`` is XXH3-128 of that serialization up to the end of message ``j-1``: the
    same messages (same types, same key order) always give the same bytes, different ones
    different bytes, and turn k+1's first messages give turn k's digest. Only the messages
    after ``j`` are serialized on their own, to find where message ``j`` starts (the cache
    asks about the last few boundaries)."""

    __slots__ = ("_data", "_ends", "_low", "_messages", "count")

    def __init__(self, messages: Sequence[Any]) -> None:
        """Raises:
        TypeError: a value ``orjson`` cannot serialize (nothing is cached then)."""
        self._data = orjson.dumps(messages)
        self._messages = messages
        self.count = len(messages)
        # _ends[j]: the offset just past message j - 1, the comma before message j (or
        # the closing bracket), known from the last message down to _low
        self._low = self.count
        self._ends = {self.count: len(self._data) - 1}

    def end(self, j: int) -> int:
        """The offset just past message ``j - 1``."""
        ends = self._ends
        if j >= self._low:
            return ends[j]
        off, data, messages = ends[self._low], self._data, self._messages
        for k in range(self._low - 1, j - 1, -1):
            off -= len(orjson.dumps(messages[k])) + 1
            if k and data[off] != 0x2C:  # a comma (before message 0: the bracket)
                raise ValueError("messages serialized apart differ from the whole")
            ends[k] = off
        self._low = j
        return off

    def digest(self, j: int) -> bytes:
        """The digest of the first ``j`` messages (1 <= j <= count)."""
        return xxhash.xxh3_128_digest(memoryview(self._data)[: self.end(j)])

    def digests(self, low: int) -> list[bytes]:
        """The digests of the first ``j`` messages for ``j`` from ``low`` to ``count``, in
        one pass over the bytes (``low`` >= 1)."""
        self.end(low)
        view, ends = memoryview(self._data), self._ends
        h = xxhash.xxh3_128()
        at = ends[low]
        h.update(view[:at])
        out = [h.digest()]
        for j in range(low + 1, self.count + 1):
            end = ends[j]
            h.update(view[at:end])
            at = end
            out.append(h.digest())
        return out


@dataclass(frozen=True, slots=True)
class CacheEntry:
    head: str
    """The text the template outputs before its message loop."""
    values: tuple[Any, ...]
    """The loop-start values (the plan's snapshot names, then its guards' values)."""
    state: ChainState
    keys: tuple[ChainKey, ...]
    plan: Any
    """The template's plan the entry was rendered with (the same one must reuse it)."""
    chat: tuple[dict[str, Any], ...]
    """The template's messages up to the boundary, as prepared (not prepared again)."""
    nbytes: int


def entry_size(
    head: str, state: ChainState, keys: int, values: tuple[Any, ...], prompt_bytes: int
) -> int:
    """About what an entry holds: its own strings and keys, the loop-start values, and
    the prepared messages (counted as the prompt's length, though entries of one
    conversation share them)."""
    size = _ENTRY_OVERHEAD + len(head) + len(state.partial) + 16 * keys + prompt_bytes
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

    def find(
        self, prefix: tuple[Any, ...], digests: MessageDigests, probes: int
    ) -> tuple[int, bytes | None]:
        """The longest ``j`` <= ``digests.count`` (the last ``probes`` + 1 tried) with an
        entry, and its digest; ``(0, None)`` when none has one. (``j`` may be all the
        messages: a retry, or a turn that only changes what follows the loop.)"""
        entries = self._entries
        low = max(1, digests.count - probes)
        near = digests.digests(low)
        for j in range(digests.count, low - 1, -1):
            d = near[j - low]
            if (*prefix, d) in entries:
                return j, d
        return 0, None

    def get(self, key: tuple[Any, ...]) -> CacheEntry:
        entry = self._entries[key]
        self._entries.move_to_end(key)
        return entry

    def drop(self, key: tuple[Any, ...]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes

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
