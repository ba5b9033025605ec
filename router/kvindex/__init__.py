"""Tier 4: the KV cache index (which backend holds which prefix), memory or Redis.

``build_kv_index`` turns ``kv_cache_index`` (+ the shared ``response_cache.redis``) into a
:class:`KvIndex`; ``apply_event`` feeds it the listener's events. See ``base`` for the
contract every backend and wrapper honours. The index knows nothing of where its events
come from (``router.ingest`` reads them, ``router.kv_runtime`` wires the two together).

Conversation-depth routing uses a second instance of the same classes, the chain index
(``build_kv_index(..., key_prefix=CHAIN_KEY_PREFIX, max_entries=conversation.max_entries)``),
keyed by ``bus.prompt_chain`` keys; ``chains``, ``cost``, ``prefill`` and ``accuracy``
hold its query, cost model, load ledger and predicted-vs-delivered sums.
"""

from __future__ import annotations

from router.config.models import KvCacheIndexConfig, RedisConfig
from router.redis import RedisPools, build_client

from .apply import ACTIONS, Action, apply_event, apply_events, end_resync
from .base import (
    EMPTY,
    Change,
    IndexEntry,
    IndexStats,
    Key,
    KvIndex,
    KvIndexError,
    KvIndexUnavailable,
    StorageTier,
)
from .fallback import FallbackKvIndex
from .instrumented import InstrumentedKvIndex
from .memory import InMemoryKvIndex
from .redis_index import DEFAULT_KEY_PREFIX, RedisKvIndex, Restore

CHAIN_KEY_PREFIX = "cr:kvchain:"
"""The chain index's Redis namespace (the prefix index keeps ``cr:kvidx:``)."""

__all__ = [
    "ACTIONS",
    "CHAIN_KEY_PREFIX",
    "DEFAULT_KEY_PREFIX",
    "EMPTY",
    "Action",
    "Change",
    "FallbackKvIndex",
    "InMemoryKvIndex",
    "IndexEntry",
    "IndexStats",
    "InstrumentedKvIndex",
    "Key",
    "KvIndex",
    "KvIndexError",
    "KvIndexUnavailable",
    "RedisKvIndex",
    "Restore",
    "StorageTier",
    "apply_event",
    "apply_events",
    "build_kv_index",
    "end_resync",
]


def build_kv_index(
    config: KvCacheIndexConfig,
    redis_config: RedisConfig | None,
    *,
    pools: RedisPools | None = None,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    max_entries: int | None = None,
) -> InstrumentedKvIndex:
    """The index ``config.backend`` names, instrumented. No I/O; safe outside a running loop.

    * ``memory``: ``InstrumentedKvIndex(InMemoryKvIndex(max_entries, entry_ttl_seconds))``.
    * ``redis``: a ``RedisKvIndex`` on the client ``pools`` hands out for ``redis_config``
      (the response cache's connection pool, shared; in any ``mode``, a Cluster's keys laid
      out per backend as ``redis_index`` explains). With ``fallback_to_memory`` it is
      wrapped in a ``FallbackKvIndex`` whose fallback is an ``InMemoryKvIndex`` sized like
      the memory backend (``max_entries``, ``entry_ttl_seconds``;
      ``fallback_capacity``/``fallback_ttl_seconds`` size the response cache's fallback,
      not this one), retried every ``health_check_interval_ms``; without it an outage
      raises :class:`KvIndexUnavailable`. Then ``InstrumentedKvIndex`` around that.

    Args:
        pools: the router's registry of shared Redis clients (it closes them). When
            omitted, the index gets a client of its own, closed by ``index.close()``.
        key_prefix: the Redis namespace (:data:`CHAIN_KEY_PREFIX` for the chain index).
        max_entries: keys kept in memory instead of ``config.max_entries`` (the chain
            index: ``conversation.max_entries``).

    Raises:
        ValueError: ``backend: redis`` without ``redis_config``.
    """
    ttl = float(config.entry_ttl_seconds)
    size = config.max_entries if max_entries is None else max_entries
    if config.backend == "memory":
        return InstrumentedKvIndex(InMemoryKvIndex(size, ttl))
    if redis_config is None:
        raise ValueError(
            "kv_cache_index.backend: redis requires response_cache.redis "
            "(the shared connection pool)"
        )
    owned = pools is None
    client = build_client(redis_config) if pools is None else pools.client(redis_config)
    primary = RedisKvIndex(client, ttl, key_prefix, owns_redis=owned)
    if not redis_config.fallback_to_memory:
        return InstrumentedKvIndex(primary)
    return InstrumentedKvIndex(
        FallbackKvIndex(
            primary,
            InMemoryKvIndex(size, ttl),
            monitor_interval_s=redis_config.health_check_interval_ms / 1000.0,
        )
    )
