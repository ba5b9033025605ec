"""Keyspace-wide operations (SCAN, multi-key UNLINK) that work on one server and on a Cluster.

On a Redis Cluster a SCAN cursor belongs to one node, and a multi-key command must keep to
one hash slot. So :func:`scan_pages` walks every primary in turn (replicas hold copies),
and :func:`unlink` sends one ``UNLINK`` per slot, through the client's own
``execute_command`` so that every command waits its turn on the bounded client
(``router.redis.pools``) rather than through redis-py's per-slot pipeline, which takes a
connection of every node at once. On one server both are the plain commands.

During a Cluster failover the client may still list the dead primary: its SCAN raises a
connection error like any other command, one of ``UNAVAILABLE_ERRORS``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from .pools import RedisClient

__all__ = ["scan_pages", "unlink"]

_UNLINK_CHUNK = 500


async def scan_pages(client: RedisClient, match: bytes | str, count: int) -> AsyncIterator[list]:
    """Every page of ``SCAN 0 MATCH match COUNT count`` until the cursor is 0, on every
    primary of a Cluster. Keys written meanwhile may be missed (SCAN semantics)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        for node in client.get_primaries():
            cursor = 0
            while True:
                cursors: Any
                cursors, keys = await client.scan(
                    cursor, match=match, count=count, target_nodes=node
                )
                yield keys
                cursor = cursors[node.name]
                if cursor == 0:
                    break
        return
    cursor = 0
    while True:
        cursor, keys = await client.scan(cursor, match=match, count=count)
        yield keys
        if cursor == 0:
            break


async def unlink(client: RedisClient, keys: Sequence[bytes | str]) -> int:
    """``UNLINK`` ``keys`` (in batches of 500; on a Cluster, one command per hash slot).
    Returns how many existed."""
    if not keys:
        return 0
    if isinstance(client, RedisCluster):
        by_slot: dict[int, list[bytes | str]] = {}
        for k in keys:
            by_slot.setdefault(client.keyslot(k), []).append(k)
        counts = await asyncio.gather(
            *(client.execute_command("UNLINK", *group) for group in by_slot.values())
        )
        return sum(int(n) for n in counts)
    n = 0
    for i in range(0, len(keys), _UNLINK_CHUNK):
        n += await client.unlink(*keys[i : i + _UNLINK_CHUNK])
    return n
