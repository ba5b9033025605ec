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

Modes (``mode``):

* ``standalone``: the server at ``url``.
* ``sentinel``: redis-py's own ``redis.asyncio.sentinel.Sentinel`` over ``sentinel.addresses``
  (with the sentinels' own auth and TLS), and a client on the primary it names
  (``master_for``). Every new connection asks the sentinels where the primary is, and one
  that finds a replica where the primary was (``READONLY``) is dropped, so after a failover
  the client reconnects to the new primary by itself; the pool is blocking too
  (``_BlockingSentinelPool``).

* ``cluster``: redis-py's ``redis.asyncio.cluster.RedisCluster`` over
  ``cluster.startup_nodes`` (the data nodes' auth and TLS): it reads the slot map from any
  node that answers and sends each command to the primary of its key's slot. A connection
  error marks the topology stale, so the next command re-reads it and, once the cluster
  has promoted a replica, reaches the new primary by itself. Its per-node pools
  (``pool_size`` connections each) fail at once when full instead of waiting, so
  :class:`_BoundedCluster` lets at most ``pool_size`` commands run at a time, the others
  waiting up to the connect timeout like the standalone pool. The cluster-level retry is
  ``Retry(NoBackoff(), 1)`` too. ``RedisPools.client`` hands it out (to the response cache
  and the KV index); ``RedisPools.get`` refuses it (it promises one server).

In all modes, a command that fails while a primary is away raises one of
:data:`UNAVAILABLE_ERRORS`, which the stores answer from memory (counted) until it answers.

The registry must be closed (``await pools.aclose()``) by whoever created it; clients are
bound to the event loop that first used them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeAlias, overload

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from bus.config import parse_hostport
from router.config.models import RedisConfig
from router.http.tls import MINIMUM_VERSION

__all__ = [
    "UNAVAILABLE_ERRORS",
    "RedisClient",
    "RedisPools",
    "build_client",
    "build_redis",
    "close_client",
    "effective_url",
    "glob_escape",
    "send_by_node",
]

_CLIENT_NAME = "continuum-router"

RedisClient: TypeAlias = Redis | RedisCluster
"""A client of any mode: one server (standalone, Sentinel's primary) or a Cluster."""


def effective_url(config: RedisConfig) -> str:
    """The URL actually dialled: ``tls: true`` turns ``redis://`` into ``rediss://``."""
    url = config.url
    if config.tls and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    return url


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (connections dial the primary the sentinels name) that waits for a
    free connection like the standalone one instead of failing when all are busy."""


def _tls(config: RedisConfig, on: bool) -> dict[str, Any]:
    if not on:
        return {}
    kw: dict[str, Any] = {"ssl": True, "ssl_min_version": MINIMUM_VERSION}
    if config.tls_ca_file:
        kw["ssl_ca_certs"] = config.tls_ca_file
    return kw


def _socket(config: RedisConfig) -> dict[str, Any]:
    connect_s = config.connect_timeout_ms / 1000.0
    return {
        "socket_connect_timeout": connect_s,
        "socket_timeout": config.command_timeout_ms / 1000.0,
        "retry": Retry(NoBackoff(), 1),
    }


def _data_nodes(config: RedisConfig) -> dict[str, Any]:
    """Connection settings for the data nodes (Sentinel's primary, a Cluster's nodes)."""
    return {
        "username": config.username,
        "password": config.password,
        "decode_responses": False,
        "client_name": _CLIENT_NAME,
        **_socket(config),
        **_tls(config, config.tls),
    }


def _sentinel_client(config: RedisConfig) -> Redis:
    s = config.sentinel
    assert s is not None  # RedisConfig refuses mode: sentinel without it
    sentinel = Sentinel(
        [parse_hostport(a) for a in s.addresses],
        sentinel_kwargs={
            **_socket(config),
            "username": s.username,
            "password": s.password,
            **_tls(config, s.tls),
        },
    )
    return sentinel.master_for(
        s.master_name,
        redis_class=Redis,
        connection_pool_class=_BlockingSentinelPool,
        max_connections=config.pool_size,
        timeout=config.connect_timeout_ms / 1000.0,
        db=s.db,
        **_data_nodes(config),
    )


class _BoundedCluster(RedisCluster):
    """A ``RedisCluster`` that runs at most ``limit`` commands at a time: a caller waits
    (up to ``wait_s``) for a turn instead of meeting a full per-node pool, which fails at
    once (``MaxConnectionsError``) and would trip the memory fallback on a mere burst.

    It also reads the slot map once for all waiting commands (at the first command and
    whenever an error marked it stale): a burst of commands on a client that had not read
    it yet went out by the default node, drew MOVED replies and re-initialisations that
    dropped the connections of the commands still running (seen with redis-py 8.1)."""

    def __init__(self, *args: Any, limit: int, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = asyncio.Semaphore(limit)
        self._wait_s = wait_s
        self._map_lock = asyncio.Lock()

    async def _turn(self) -> None:
        """Wait for a turn (release it with ``self._turns.release()``)."""
        try:
            async with asyncio.timeout(self._wait_s):
                await self._turns.acquire()
        except TimeoutError:
            raise redis.exceptions.MaxConnectionsError(
                f"no free cluster connection within {self._wait_s:g}s"
            ) from None

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            async with self._map_lock:
                if self._initialize:
                    await self.initialize()
        await self._turn()
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._turns.release()

    async def send_by_node(self, commands: Sequence[tuple[Any, Sequence[Any]]]) -> list[Any] | None:
        """``(slot key, command)`` pairs sent as one pipeline per node (a turn each),
        concurrently; the raw replies in order. None when anything is unusual (a stale
        slot map, MOVED, a missing script, a connection error): the caller then sends
        the commands one by one through :meth:`execute_command`, whose redirects,
        retries and map refreshes handle it. Only for idempotent commands.

        Why: a query of the KV index is one script call per backend; each call through
        redis-py's cluster dispatch costs more client CPU than the round trip itself, so
        three of them took ~1.3x a bare ``RedisCluster`` pipeline of the same reads."""
        if self._initialize:
            return None
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        try:
            for i, (key, _) in enumerate(commands):
                node = self.get_node_from_key(key)
                if node is None:
                    return None
                by_node.setdefault(node.name, (node, []))[1].append(i)
        except redis.exceptions.RedisClusterException:
            return None
        out: list[Any] = [None] * len(commands)

        async def one(node: ClusterNode, at: list[int]) -> None:
            await self._turn()
            try:
                conn = node.acquire_connection()
                try:
                    cmds = [commands[i][1] for i in at]
                    await conn.send_packed_command(conn.pack_commands(cmds))
                    for i in at:
                        out[i] = await conn.read_response()
                except BaseException:
                    await conn.disconnect()  # unread replies must not reach the next user
                    raise
                finally:
                    node.release(conn)
            finally:
                self._turns.release()

        done = await asyncio.gather(
            *(one(node, at) for node, at in by_node.values()), return_exceptions=True
        )
        for r in done:
            if isinstance(r, redis.exceptions.RedisError | OSError):
                return None
            if isinstance(r, BaseException):
                raise r
        return out


async def send_by_node(
    client: RedisCluster, commands: Sequence[tuple[Any, Sequence[Any]]]
) -> list[Any] | None:
    """``_BoundedCluster.send_by_node`` on the router's Cluster client; None (send them one
    by one) on any other ``RedisCluster``, which has no turns to respect."""
    if isinstance(client, _BoundedCluster):
        return await client.send_by_node(commands)
    return None


def _cluster_client(config: RedisConfig) -> RedisCluster:
    c = config.cluster
    assert c is not None  # RedisConfig refuses mode: cluster without it
    return _BoundedCluster(
        startup_nodes=[ClusterNode(*parse_hostport(a)) for a in c.startup_nodes],
        limit=config.pool_size,
        wait_s=config.connect_timeout_ms / 1000.0,
        max_connections=config.pool_size,
        **_data_nodes(config),
    )


def build_client(config: RedisConfig) -> RedisClient:
    """A new client of any mode with its own pool(s). Prefer :meth:`RedisPools.client`."""
    if config.mode == "cluster":
        return _cluster_client(config)
    return build_redis(config)


def build_redis(config: RedisConfig) -> Redis:
    """A new single-server client (standalone, Sentinel) with its own pool. Prefer
    :meth:`RedisPools.get`, which shares one.

    Raises:
        ValueError: ``mode: cluster`` (use :func:`build_client`).
    """
    if config.mode == "cluster":
        raise ValueError(
            "a Redis Cluster has no single server for this client "
            "(response_cache.redis.mode: cluster; use build_client)"
        )
    if config.mode == "sentinel":
        return _sentinel_client(config)
    connect_s = config.connect_timeout_ms / 1000.0
    url = effective_url(config)
    tls: dict[str, Any] = {}
    if url.startswith("rediss://"):
        tls = {"ssl_min_version": MINIMUM_VERSION}
        if config.tls_ca_file:
            tls["ssl_ca_certs"] = config.tls_ca_file
    auth = {k: v for k, v in (("username", config.username), ("password", config.password)) if v}
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=config.pool_size,
        timeout=connect_s,
        decode_responses=False,
        client_name=_CLIENT_NAME,
        **_socket(config),
        **tls,
        **auth,
    )
    return Redis(connection_pool=pool)


async def close_client(client: RedisClient) -> None:
    """Close ``client`` and its pool, and a Sentinel client's connections to the sentinels
    (a Cluster client: its connections to every node)."""
    if isinstance(client, RedisCluster):
        await client.aclose()
        return
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    await client.aclose(close_connection_pool=True)
    if manager is not None:
        for s in manager.sentinels:
            await s.aclose(close_connection_pool=True)


_CONNECTION_FIELDS = {
    "mode",
    "url",
    "tls",
    "username",
    "password",
    "tls_ca_file",
    "sentinel",
    "cluster",
    "pool_size",
    "connect_timeout_ms",
    "command_timeout_ms",
}


def _pool_key(config: RedisConfig) -> str:
    return config.model_copy(update={"url": effective_url(config)}).model_dump_json(
        include=_CONNECTION_FIELDS
    )


class RedisPools:
    """Hands out one shared client per distinct connection config (mode, addresses, auth,
    TLS, pool_size, timeouts)."""

    def __init__(self) -> None:
        self._clients: dict[str, RedisClient] = {}

    def client(self, config: RedisConfig) -> RedisClient:
        """The shared client for ``config`` in any mode, created on first use (no I/O)."""
        key = _pool_key(config)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = build_client(config)
        return client

    def get(self, config: RedisConfig) -> Redis:
        """The shared client for ``config`` when it is one server (standalone, Sentinel).

        Raises:
            ValueError: ``mode: cluster``.
        """
        if config.mode == "cluster":
            build_redis(config)  # raises, with the reason
        client = self.client(config)
        assert isinstance(client, Redis)
        return client

    def __len__(self) -> int:
        return len(self._clients)

    async def aclose(self) -> None:
        """Close every client and its pool. Idempotent."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await close_client(client)


UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,  # refused, reset, loading, pool exhausted, auth
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica after failover
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.MasterDownError,
    redis.exceptions.ClusterDownError,  # CLUSTERDOWN: a Cluster's slots unserved
    redis.exceptions.RedisClusterException,  # no Cluster node reachable, slot not covered
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
