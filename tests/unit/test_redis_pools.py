"""The shared Redis client registry and client settings (``router.redis.pools``)."""

from __future__ import annotations

import ssl

from router.config.models import RedisConfig
from router.redis import RedisPools, build_redis, effective_url, glob_escape


async def test_redis_pools_share_one_client_per_config() -> None:
    pools = RedisPools()
    try:
        a = RedisConfig(url="redis://127.0.0.1:6379", pool_size=3, key_prefix="cr:resp:")
        same = a.model_copy(update={"key_prefix": "other:", "fallback_capacity": 9})
        bigger = a.model_copy(update={"pool_size": 4})
        assert pools.get(a) is pools.get(same)
        assert pools.get(a) is not pools.get(bigger)
        assert len(pools) == 2
        pool = pools.get(a).connection_pool
        assert pool.max_connections == 3
        kw = pool.connection_kwargs
        assert kw["socket_connect_timeout"] == 3.0 and kw["socket_timeout"] == 1.0
    finally:
        await pools.aclose()
    assert len(pools) == 0


def test_effective_url_upgrades_to_tls() -> None:
    assert effective_url(RedisConfig(url="redis://h:1")) == "redis://h:1"
    assert effective_url(RedisConfig(url="redis://h:1", tls=True)) == "rediss://h:1"
    assert effective_url(RedisConfig(url="rediss://h:1")) == "rediss://h:1"
    tls_pool = build_redis(RedisConfig(url="redis://h:1", tls=True)).connection_pool
    assert tls_pool.connection_class.__name__ == "SSLConnection"


def test_glob_escape_matches_only_the_literal() -> None:
    assert glob_escape("a*b?[c]\\") == "a\\*b\\?\\[c\\]\\\\"
    assert glob_escape(b"cr:kv*") == b"cr:kv\\*"
    assert glob_escape("plain:") == "plain:"


def _sentinel(**over: object) -> RedisConfig:
    return RedisConfig.model_validate(
        {
            "mode": "sentinel",
            "password": "data-pw",
            "sentinel": {
                "master_name": "m",
                "addresses": ["127.0.0.1:26379", "[::1]:26380"],
                "password": "sentinel-pw",
                **over.pop("sentinel", {}),  # type: ignore[dict-item]
            },
            **over,
        }
    )


async def test_sentinel_client_settings_reach_both_kinds_of_connection() -> None:
    """Auth and TLS of the data nodes and of the sentinels are kept apart; both pools
    keep the standalone client's timeouts, and the data pool blocks when all its
    connections are busy."""
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio.connection import SSLConnection
    from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

    cfg = _sentinel(tls=True, tls_ca_file="/ca.crt", pool_size=5, sentinel={"tls": True})
    pools = RedisPools()
    try:
        pool = pools.get(cfg).connection_pool
        assert isinstance(pool, BlockingConnectionPool) and pool.max_connections == 5
        assert pool.connection_class is SentinelManagedSSLConnection
        kw = pool.connection_kwargs
        assert (kw["password"], kw["ssl_ca_certs"]) == ("data-pw", "/ca.crt")
        assert kw["ssl_min_version"] == ssl.TLSVersion.TLSv1_2
        assert kw["socket_connect_timeout"] == 3.0 and kw["socket_timeout"] == 1.0
        sentinels = pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
        assert [(s.connection_pool.connection_kwargs["host"],
                 s.connection_pool.connection_kwargs["port"]) for s in sentinels] == [
            ("127.0.0.1", 26379), ("::1", 26380)]  # fmt: skip
        for s in sentinels:
            skw = s.connection_pool.connection_kwargs
            assert s.connection_pool.connection_class is SSLConnection
            assert (skw["password"], skw["ssl_ca_certs"]) == ("sentinel-pw", "/ca.crt")
            assert skw["socket_timeout"] == 1.0
        plain = pools.get(_sentinel()).connection_pool
        assert plain.connection_class is SentinelManagedConnection
        assert "ssl_min_version" not in plain.connection_kwargs
        assert pools.get(_sentinel()) is not pools.get(cfg)  # a separate pool per config
    finally:
        await pools.aclose()
