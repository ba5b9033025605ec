"""Redis's clock, read locally: the time every router sharing one Redis index agrees on.

Entries in the shared index carry Unix-millisecond expiries, and the periodic sweep
deletes the ones past them. With each router's own wall clock, one router whose clock
steps forward (a bad NTP correction, a VM resumed from a snapshot) deletes every other
router's live entries on its next sweep. So the index keeps time by the Redis server's
``TIME``: :meth:`ServerClock.sync` reads it (one round trip) and the clock then advances by
the process's monotonic clock, which no wall-clock step moves. The sweep syncs before it
deletes anything; until the first sync the clock is the local wall clock.

Between syncs the clock drifts only as far as the monotonic clock does from Redis's
(parts per million); the round trip of the ``TIME`` call itself bounds the error at sync
(half of it is credited as the reply's age).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster

from router.redis import RedisClient

__all__ = ["ServerClock"]


class ServerClock:
    """Unix seconds on Redis's clock (module docstring); callable like ``time.time``."""

    __slots__ = ("_base_mono", "_base_unix", "_mono", "synced")

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mono = monotonic
        self._base_unix = wall()
        self._base_mono = monotonic()
        self.synced = False
        """Whether a ``TIME`` reply has set the clock (else it started from ``wall``)."""

    def __call__(self) -> float:
        return self._base_unix + (self._mono() - self._base_mono)

    async def sync(self, redis: RedisClient, key: bytes = b"") -> None:
        """Set the clock from the server's ``TIME`` (raises what the client raises). On a
        Cluster, the ``TIME`` of the primary serving ``key``: every router asks the same
        node, whose clock they then share."""
        sent = self._mono()
        if isinstance(redis, RedisCluster):
            await redis.initialize()
            node = redis.get_node_from_key(key)  # type: ignore[arg-type]  # bytes work too
            reply: Any = await redis.execute_command("TIME", target_nodes=node)
            if isinstance(reply, dict):  # {node name: reply}
                (reply,) = reply.values()
            seconds, micros = int(reply[0]), int(reply[1])
        else:
            seconds, micros = await redis.time()
        received = self._mono()
        self._base_unix = seconds + micros / 1e6 + (received - sent) / 2
        self._base_mono = received
        self.synced = True
