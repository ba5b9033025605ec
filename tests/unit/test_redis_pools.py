"""The shared Redis client registry and client settings (``router.redis.pools``)."""

from __future__ import annotations

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
