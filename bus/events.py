"""KV cache events: what the listener publishes and the router indexes.

One JSON object per SSE record (docs/ARCHITECTURE.md §4)::

    {"event":"cache_created","backend":"vllm-1","prefix_hash":"<64 hex>",
     "token_count":2048,"tier":"gpu"}
    {"event":"chain_created","backend":"vllm-1","chain_key":"<32 hex>",
     "token_count":4100,"tier":"gpu"}

Kinds, past tense like the engines' own events. Per prefix (``prefix_hash``, the hex of a
``bus.prefix_key`` digest):

* ``cache_created``   a prefix gained its first blocks on the backend, or grew
                      (``token_count`` is the longest cached chain under it);
* ``cache_offloaded`` its blocks now live only in a slower tier (CPU, disk, remote);
* ``cache_evicted``   its last block is gone.

Per prompt chain key (``chain_key``, the hex of a ``bus.prompt_chain`` key: every byte of
the rendered prompt up to the end of one chunk):

* ``chain_created``   every token up to the chunk's end is in stored blocks
                      (``token_count``: how many tokens that is; ``tier`` gpu);
* ``chain_offloaded`` they are stored, but some only in a slower tier (``tier`` storage);
* ``chain_evicted``   a block at or before the chunk's end is gone: the key is withdrawn.

A backend's chain keys are prefix-closed: when it holds key i it holds every key before
it, so a router finds the deepest one by search. For the whole backend:

* ``cache_cleared``   the engine dropped every block: forget the backend's entries;
* ``resync``          the stream restarted or a gap was found: forget the backend's
                      entries; a snapshot of ``cache_created``/``chain_created`` follows
                      (``snapshot_size``: how many records, when the sender says; the
                      router then swaps the snapshot in whole once the last one arrived).

Neither key is ever an engine block hash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from .errors import BusError

__all__ = [
    "BACKEND_NAME_RE",
    "CHAIN_KINDS",
    "EVENT_KINDS",
    "TIERS",
    "EventError",
    "KvEvent",
]

EventKind = Literal[
    "cache_created",
    "cache_evicted",
    "cache_offloaded",
    "chain_created",
    "chain_evicted",
    "chain_offloaded",
    "cache_cleared",
    "resync",
]
EVENT_KINDS: frozenset[str] = frozenset(
    (
        "cache_created",
        "cache_evicted",
        "cache_offloaded",
        "chain_created",
        "chain_evicted",
        "chain_offloaded",
        "cache_cleared",
        "resync",
    )
)
CHAIN_KINDS: frozenset[str] = frozenset(("chain_created", "chain_evicted", "chain_offloaded"))
_COUNTED = frozenset(("chain_created", "chain_offloaded"))
StorageTier = Literal["gpu", "storage"]
TIERS: frozenset[str] = frozenset(("gpu", "storage"))
_PREFIXED = frozenset(("cache_created", "cache_evicted", "cache_offloaded"))
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")  # \Z, not $: "$" also matches before a final LF
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
BACKEND_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_MAX_TOKENS = 1 << 40
_MAX_VALID_BACKENDS = 4096
_valid_backends: set[str] = set()
"""Backend names already checked against ``BACKEND_NAME_RE``: a stream repeats one name."""


class EventError(BusError, ValueError):
    """A record that is not a valid event; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class KvEvent:
    event: EventKind
    backend: str
    prefix_hash: str | None = None
    token_count: int | None = None
    tier: StorageTier | None = None
    reason: str | None = None
    """Why a ``resync`` happened (``restart``, ``gap``, ``unknown_id``, ``decode_error``,
    ``malformed_event``, ``tracker_error``, ``callback_error``...); informational."""
    chain_key: str | None = None
    """The hex of a ``bus.prompt_chain`` key, for the ``chain_*`` kinds."""
    snapshot_size: int | None = None
    """For ``resync``: how many snapshot records follow it (None: not said). An invalid
    value reads as None: a resync is never dropped for it."""
    incomplete: bool = False
    """``resync`` only: the state that follows may lack entries the engine holds (the
    listener resumed from a checkpoint and events of its downtime could not be
    replayed). Nothing listed is invented; some holdings may be missing until stored
    again. Sent as ``"incomplete": true``, absent otherwise."""

    def to_json(self) -> bytes:
        d: dict[str, Any] = {"event": self.event, "backend": self.backend}
        if self.prefix_hash is not None:
            d["prefix_hash"] = self.prefix_hash
        if self.chain_key is not None:
            d["chain_key"] = self.chain_key
        if self.token_count is not None:
            d["token_count"] = self.token_count
        if self.tier is not None:
            d["tier"] = self.tier
        if self.reason is not None:
            d["reason"] = self.reason
        if self.snapshot_size is not None:
            d["snapshot_size"] = self.snapshot_size
        if self.incomplete:
            d["incomplete"] = True
        return orjson.dumps(d)

    @classmethod
    def from_json(
        cls, data: bytes | str, *, event_field: str | None = None, backend: str | None = None
    ) -> KvEvent:
        """Parse and validate one record.

        ``event_field`` is the SSE ``event:`` value, which wins over the JSON ``event``;
        ``backend`` (the stream's own backend) wins over the JSON ``backend`` so a stream
        can only ever speak for the backend it was opened for.
        """
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise EventError(f"not JSON: {exc}") from None
        if type(obj) is not dict:
            raise EventError("event must be a JSON object")
        get = obj.get
        kind = event_field or get("event")
        # ``type(x) is str`` before set membership: a JSON array is unhashable.
        if type(kind) is not str or kind not in EVENT_KINDS:
            raise EventError(f"unknown event kind {kind!r}")
        be = backend if backend is not None else get("backend")
        if type(be) is not str or be not in _valid_backends:
            if type(be) is not str or not BACKEND_NAME_RE.match(be):
                raise EventError(f"invalid backend {be!r}")
            if len(_valid_backends) < _MAX_VALID_BACKENDS:
                _valid_backends.add(be)
        prefix = get("prefix_hash")
        chain = None
        if kind in _PREFIXED:
            if type(prefix) is not str or not _HEX64.match(prefix):
                raise EventError("prefix_hash must be 64 lowercase hex characters")
        else:
            prefix = None
            if kind in CHAIN_KINDS:
                chain = get("chain_key")
                if type(chain) is not str or not _HEX32.match(chain):
                    raise EventError("chain_key must be 32 lowercase hex characters")
        count = get("token_count")
        if count is not None and (type(count) is not int or not 0 <= count < _MAX_TOKENS):
            raise EventError("token_count must be a non-negative integer")
        if count is None and kind in _COUNTED:
            raise EventError(f"{kind} needs a token_count")
        tier = get("tier")
        if tier is not None and (type(tier) is not str or tier not in TIERS):
            raise EventError(f"unknown tier {tier!r}")
        reason = get("reason")
        if reason is not None and type(reason) is not str:
            reason = None
        size = get("snapshot_size") if kind == "resync" else None
        if size is not None and (type(size) is not int or not 0 <= size < _MAX_TOKENS):
            size = None
        # What the frozen dataclass's __init__ does, at half its cost (slot descriptors
        # instead of object.__setattr__ per field): this runs once per event in the router.
        ev = _new(cls)
        _set_event(ev, kind)
        _set_backend(ev, be)
        _set_prefix_hash(ev, prefix)
        _set_token_count(ev, count)
        _set_tier(ev, tier)
        _set_reason(ev, reason)
        _set_chain_key(ev, chain)
        _set_snapshot_size(ev, size)
        _set_incomplete(ev, kind == "resync" and get("incomplete") is True)
        return ev


_new = object.__new__
_slot = vars(KvEvent)  # the slot descriptors, by field name
_set_event = _slot["event"].__set__
_set_backend = _slot["backend"].__set__
_set_prefix_hash = _slot["prefix_hash"].__set__
_set_token_count = _slot["token_count"].__set__
_set_tier = _slot["tier"].__set__
_set_reason = _slot["reason"].__set__
_set_chain_key = _slot["chain_key"].__set__
_set_snapshot_size = _slot["snapshot_size"].__set__
_set_incomplete = _slot["incomplete"].__set__
