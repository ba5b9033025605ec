"""Redis for tests: ``REDIS_URL``, else a private ``redis-server``, else skip (or fail).

Use from a test module with ``pytest_plugins = ("tests.redis_fixture",)``.

* ``redis_url`` (session): ``$REDIS_URL`` if set; otherwise a private ``redis-server`` on a
  free loopback port (``--save "" --appendonly no``), stopped at the end of the session.
* ``redis_server`` (function): always a private server, for tests that kill, pause or
  restart it (never the shared one).
* ``sentinel_set`` (function): :class:`SentinelSet`, a primary, a replica and three
  ``redis-server --sentinel`` processes watching them, with passwords on the data nodes
  and on the sentinels and a 1 s ``down-after-milliseconds``, so a killed primary is
  replaced in a few seconds. ``sentinel_tls_set``: the same, every process TLS only, with
  certificates from ``certs``.
* ``cluster_set`` (function): :class:`ClusterSet`, a Redis Cluster of three primaries and
  three replicas (``--cluster-enabled yes``, a password, a 1 s node timeout, slots assigned
  by ``redis-cli --cluster create``), ready (``cluster_state:ok`` everywhere, replicas
  synced); the test may kill and restart any node. ``cluster_tls_set``: the same, TLS
  only (a client certificate for the bus).
* ``shared_cluster`` (session): one such Cluster for a whole session, for tests that only
  read and write (never kill a node); each uses a key prefix of its own.

``redis_pools`` (function): a ``RedisPools`` registry closed after the test.

Without Redis the tests skip, unless ``CONTINUUM_REQUIRE_REDIS=1`` (CI): then they fail.
Readiness is awaited by PINGing, never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from harness.redis_procs import ClusterSet, RedisServer, SentinelSet, TlsFiles
from router.redis import RedisPools

__all__ = [
    "ClusterSet",
    "RedisServer",
    "SentinelSet",
    "cluster_set",
    "cluster_tls_set",
    "redis_pools",
    "redis_server",
    "redis_url",
    "require_redis",
    "sentinel_set",
    "sentinel_tls_set",
    "shared_cluster",
    "unavailable",
]

REQUIRE_ENV = "CONTINUUM_REQUIRE_REDIS"


def require_redis() -> bool:
    """True when missing Redis must fail the test instead of skipping it (CI)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Skip, or fail when ``CONTINUUM_REQUIRE_REDIS`` is set. Never returns."""
    if require_redis():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def _executable() -> str | None:
    return shutil.which("redis-server")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis to run against: ``$REDIS_URL``, or a private server for the session."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    exe = _executable()
    if exe is None:
        unavailable("no REDIS_URL and no redis-server on PATH")
    server = RedisServer(exe)  # type: ignore[arg-type]
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private server this test may kill and restart (needs redis-server on PATH)."""
    exe = _executable()
    if exe is None:
        unavailable("redis-server not on PATH (needed to kill and restart a private Redis)")
    server = RedisServer(exe)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.close()


_Deployment = TypeVar("_Deployment", SentinelSet, ClusterSet)


def _deployment(
    kind: Callable[..., _Deployment], what: str, tls: TlsFiles | None
) -> Iterator[_Deployment]:
    """Start ``kind(redis-server, tls=tls)``, wait until it is ready, close it after."""
    exe = _executable()
    if exe is None or shutil.which("redis-cli") is None:
        unavailable(f"redis-server and redis-cli not on PATH (needed for {what})")
    deployment = kind(exe, tls=tls)
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        deployment.close()


def _sentinels(tls: TlsFiles | None) -> Iterator[SentinelSet]:
    yield from _deployment(SentinelSet, "Sentinel", tls)


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    """A private primary + replica + three sentinels (needs redis-server on PATH)."""
    yield from _sentinels(None)


@pytest.fixture
def sentinel_tls_set(tmp_path: Path) -> Iterator[SentinelSet]:
    """``sentinel_set`` with TLS only; ``.tls.ca`` verifies every process."""
    from certs import dev_bundle

    b = dev_bundle(tmp_path)
    yield from _sentinels(TlsFiles(str(b["ca"].cert), str(b["server"].cert), str(b["server"].key)))


def _cluster(tls: TlsFiles | None) -> Iterator[ClusterSet]:
    yield from _deployment(ClusterSet, "Redis Cluster", tls)


@pytest.fixture
def cluster_set() -> Iterator[ClusterSet]:
    """A private Redis Cluster, 3 primaries + 3 replicas (needs redis-server, redis-cli)."""
    yield from _cluster(None)


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[ClusterSet]:
    """One Cluster for the session (3 primaries + 3 replicas); never kill its nodes."""
    yield from _cluster(None)


@pytest.fixture
def cluster_tls_set(tmp_path: Path) -> Iterator[ClusterSet]:
    """``cluster_set`` with TLS only (clients, cluster bus, replication); ``.tls.ca``
    verifies every node."""
    from certs import dev_bundle

    b = dev_bundle(tmp_path, clients=("node",))
    ca, srv, node = b["ca"], b["server"], b["node"]
    yield from _cluster(
        TlsFiles(str(ca.cert), str(srv.cert), str(srv.key), str(node.cert), str(node.key))
    )


@pytest.fixture
async def redis_pools() -> AsyncIterator[RedisPools]:
    """The router's registry of shared Redis clients, closed after the test."""
    p = RedisPools()
    try:
        yield p
    finally:
        await p.aclose()
