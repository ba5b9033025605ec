"""Redis plumbing shared by the router's Redis-backed stores (response cache, KV index).

``pools``: one client (and connection pool) per distinct connection config, the errors
that mean "Redis is not usable now", SCAN-pattern escaping. ``fallback``: the supervisor
that switches a store between Redis and its in-memory fallback and back.
"""

from .fallback import FallbackSupervisor, SupervisedStore
from .pools import (
    UNAVAILABLE_ERRORS,
    RedisClient,
    RedisPools,
    build_client,
    build_redis,
    close_client,
    effective_url,
    glob_escape,
    send_by_node,
)

__all__ = [
    "UNAVAILABLE_ERRORS",
    "FallbackSupervisor",
    "RedisClient",
    "RedisPools",
    "SupervisedStore",
    "build_client",
    "build_redis",
    "close_client",
    "effective_url",
    "glob_escape",
    "send_by_node",
]
