"""One Redis client (and connection pool) per distinct connection config, shared by users.

The response cache and the KV index both take their client from a :class:`RedisPools`
registry, so one ``response_cache.redis`` section means one pool of ``pool_size``
connections for the whole router.

Client settings, from :class:`~router.config.models.RedisConfig`:

* ``BlockingConnectionPool(max_connections=pool_size)``: a caller waits (up to the connect
  timeout) for a free connection instead of failing with "Too many connections", so a burst
  of concurrent queries queues rather than tripping the memory fallback;
* ``socket_connect_timeout = connect_timeout_ms``, ``socket_timeout = command_timeout_ms``;
* TLS (1.2 at least) for ``rediss://`` URLs, or for ``redis://`` ones when ``tls: true``;
* ``Retry(NoBackoff(), 1)``: one immediate retry on a connection error, which absorbs the
  stale pooled connections left by a Redis restart; a Redis that is really down fails fast
  (redis-py's default, three retries with jittered backoff up to 10 s, would stall the
  caller for seconds before the fallback takes over);
* bytes responses (``decode_responses=False``); the default RESP protocol of redis-py.

The registry must be closed (``await pools.aclose()``) by whoever created it; clients are
bound to the event loop that first used them.
"""

from __future__ import annotations

from typing import overload

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.config.models import RedisConfig
from router.http.tls import MINIMUM_VERSION

__all__ = ["UNAVAILABLE_ERRORS", "RedisPools", "build_redis", "effective_url", "glob_escape"]

_CLIENT_NAME = "continuum-router"


def effective_url(config: RedisConfig) -> str:
    """The URL actually dialled: ``tls: true`` turns ``redis://`` into ``rediss://``."""
    url = config.url
    if config.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    return url


def build_redis(config: RedisConfig) -> Redis:
    """A new client with its own pool. Prefer :meth:`RedisPools.get`, which shares one."""
    connect_s = config.connect_timeout_ms / 1000.0
    url = effective_url(config)
    tls = {"ssl_min_version": MINIMUM_VERSION} if url.startswith("rediss://") else {}
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=config.pool_size,
        timeout=connect_s,
        socket_connect_timeout=connect_s,
        socket_timeout=config.command_timeout_ms / 1000.0,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
        client_name=_CLIENT_NAME,
        **tls,
    )
    return Redis(connection_pool=pool)


def _pool_key(config: RedisConfig) -> tuple[str, int, int, int]:
    return (
        effective_url(config),
        config.pool_size,
        config.connect_timeout_ms,
        config.command_timeout_ms,
    )


class RedisPools:
    """Hands out one shared client per distinct (url, tls, pool_size, timeouts)."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, int, int, int], Redis] = {}

    def get(self, config: RedisConfig) -> Redis:
        """The shared client for ``config``, created on first use (no I/O happens here)."""
        key = _pool_key(config)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = build_redis(config)
        return client

    def __len__(self) -> int:
        return len(self._clients)

    async def aclose(self) -> None:
        """Close every client and its pool. Idempotent."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose(close_connection_pool=True)


UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # refused, reset, loading, pool exhausted, auth
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica after failover
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.MasterDownError,
    OSError,  # includes the builtin TimeoutError
)
"""Errors that mean "Redis is not usable now": they switch the response cache and the KV
index to their in-memory fallbacks. Declared once, for both."""


@overload
def glob_escape(s: str) -> str: ...
@overload
def glob_escape(s: bytes) -> bytes: ...
def glob_escape(s: bytes | str) -> bytes | str:
    """``s`` as a literal in a Redis SCAN MATCH pattern (``*?[]`` and ``\\`` escaped)."""
    if isinstance(s, str):
        return "".join("\\" + c if c in "*?[]\\" else c for c in s)
    out = bytearray()
    for c in s:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)
