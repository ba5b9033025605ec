"""Tiers 2 and 3: the response cache's storage, in memory or in Redis with a memory fallback.

``build_cache_store`` turns config into a :class:`CacheStore`; ``store`` holds the contract
every backend honours (``tests/unit/test_cache_store.py`` is its conformance suite). The
request-path logic (eligibility, keys, replay) lives in ``response`` and ``service``.
"""

from __future__ import annotations

from typing import Literal

from router.config.models import RedisConfig
from router.redis import RedisPools

from .fallback import FallbackCacheStore
from .memory_store import InMemoryCacheStore
from .redis_store import DEFAULT_KEY_PREFIX, RedisCacheStore, error_kind
from .store import (
    ERROR_KINDS,
    OPERATIONS,
    CacheStats,
    CacheStore,
    CacheStoreError,
    CacheUnavailable,
    ErrorHook,
    LatencyHook,
    StateHook,
)

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "ERROR_KINDS",
    "OPERATIONS",
    "CacheStats",
    "CacheStore",
    "CacheStoreError",
    "CacheUnavailable",
    "ErrorHook",
    "FallbackCacheStore",
    "InMemoryCacheStore",
    "LatencyHook",
    "RedisCacheStore",
    "StateHook",
    "build_cache_store",
    "error_kind",
]


def build_cache_store(
    backend: Literal["memory", "redis"],
    memory_capacity: int,
    default_ttl: int,
    redis_config: RedisConfig | None = None,
    pools: RedisPools | None = None,
    *,
    observe_latency: LatencyHook | None = None,
    count_error: ErrorHook | None = None,
    on_fallback_change: StateHook | None = None,
    monitor_interval_s: float | None = None,
    stats_cache_s: float = 10.0,
) -> CacheStore:
    """The store ``backend`` names. No I/O; safe outside a running loop.

    * ``memory``: ``InMemoryCacheStore(memory_capacity, default_ttl)``.
    * ``redis``: a ``FallbackCacheStore`` around a ``RedisCacheStore`` on the client
      ``pools`` hands out for ``redis_config`` (the pool the KV index shares; any ``mode``,
      a Redis Cluster too), keys under ``redis_config.key_prefix``. With
      ``fallback_to_memory`` the fallback is an
      ``InMemoryCacheStore(fallback_capacity, fallback_ttl_seconds)``; without it an outage
      makes every operation a miss or a no-op. Redis is retried every
      ``health_check_interval_ms``.

    Args:
        memory_capacity: ``response_cache.capacity`` (memory backend only).
        default_ttl: seconds, for ``set`` without a TTL (``response_cache.ttl_seconds``).
        observe_latency: feeds ``continuum_cache_redis_latency_seconds{operation}``.
        count_error: feeds ``continuum_cache_redis_errors_total{kind}``.
        on_fallback_change: feeds ``continuum_cache_fallback_active`` (True = 1).
        monitor_interval_s: overrides ``health_check_interval_ms`` (tests).
        stats_cache_s: how long ``stats()`` reuses its Redis SCAN count.

    Raises:
        ValueError: ``backend: redis`` without ``redis_config`` or ``pools`` (the client
            must come from the shared registry), or an unknown backend.
    """
    if backend == "memory":
        return InMemoryCacheStore(memory_capacity, default_ttl)
    if backend != "redis":
        raise ValueError(f"unknown response cache backend {backend!r}")
    if redis_config is None:
        raise ValueError("response_cache.backend: redis requires response_cache.redis")
    if pools is None:
        raise ValueError("backend redis requires pools (the RedisPools shared with the KV index)")
    primary = RedisCacheStore(
        pools.client(redis_config),
        redis_config.key_prefix,
        default_ttl=default_ttl,
        observe_latency=observe_latency,
        count_error=count_error,
        stats_cache_s=stats_cache_s,
    )
    fallback = (
        InMemoryCacheStore(redis_config.fallback_capacity, redis_config.fallback_ttl_seconds)
        if redis_config.fallback_to_memory
        else None
    )
    interval = (
        monitor_interval_s
        if monitor_interval_s is not None
        else redis_config.health_check_interval_ms / 1000.0
    )
    return FallbackCacheStore(
        primary, fallback, monitor_interval_s=interval, on_state_change=on_fallback_change
    )
