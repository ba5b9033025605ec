"""Keyspace-wide operations (SCAN, multi-key UNLINK) that work on one server and on a Cluster.

On a Redis Cluster a SCAN cursor belongs to one node, and a multi-key command must keep to
one hash slot. So :func:`scan_pages` (page by page: :func:`scan_step`, which a periodic
sweep resumes where it stopped) walks every primary in turn (replicas hold copies),
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

__all__ = ["SCAN_START", "ScanPos", "scan_pages", "scan_step", "unlink"]

_UNLINK_CHUNK = 500


ScanPos = tuple[int, int]
"""Where a keyspace walk stands: (index of the primary, ordered by name; SCAN cursor on
it). ``SCAN_START`` begins a walk; a primary added or lost meanwhile may make a resumed walk
skip or repeat one node's keys, which SCAN allows anyway."""
SCAN_START: ScanPos = (0, 0)


async def scan_step(
    client: RedisClient,
    pos: ScanPos,
    match: bytes | str,
    count: int,
    type_: str | None = None,
) -> tuple[ScanPos | None, list]:
    """One ``SCAN`` page from ``pos``: ``(where to go on, or None when the walk is done,
    keys)``. On a Cluster the walk goes primary by primary (replicas hold copies)."""
    node_index, cursor = pos
    if isinstance(client, RedisCluster):
        await client.initialize()
        nodes = sorted(client.get_primaries(), key=lambda n: n.name)
        if node_index >= len(nodes):
            return None, []
        node = nodes[node_index]
        cursors: Any
        cursors, keys = await client.scan(
            cursor, match=match, count=count, _type=type_, target_nodes=node
        )
        cursor = cursors[node.name]
        if cursor != 0:
            return (node_index, cursor), keys
        return ((node_index + 1, 0) if node_index + 1 < len(nodes) else None), keys
    cursor, keys = await client.scan(cursor, match=match, count=count, _type=type_)
    return ((0, cursor) if cursor != 0 else None), keys


async def scan_pages(
    client: RedisClient, match: bytes | str, count: int, type_: str | None = None
) -> AsyncIterator[list]:
    """Every page of ``SCAN 0 MATCH match COUNT count [TYPE type_]`` until the cursor is 0,
    on every primary of a Cluster. Keys written meanwhile may be missed (SCAN semantics)."""
    pos: ScanPos | None = SCAN_START
    while pos is not None:
        pos, keys = await scan_step(client, pos, match, count, type_)
        yield keys


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
