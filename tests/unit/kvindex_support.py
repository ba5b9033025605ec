"""Helpers the KV index test modules share: prefixes, entry views, a settable clock."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from router.kvindex import IndexEntry, StorageTier
from router.redis import RedisClient
from router.redis.keyspace import scan_pages, unlink

GPU = StorageTier.GPU_HOT
WARM = StorageTier.STORAGE_WARM


def P(i: int) -> str:
    """A prefix hash (64 hex characters, like ``bus.prefix_key``'s)."""
    return f"{i:064x}"


def C(i: int) -> bytes:
    """A chain key (16 bytes, like ``bus.prompt_chain``'s)."""
    return i.to_bytes(16, "big")


def state(entries: Sequence[IndexEntry]) -> dict[str, tuple[int, StorageTier]]:
    return {e.backend: (e.token_count, e.tier) for e in entries}


def assert_sorted(entries: Sequence[IndexEntry]) -> None:
    ranks = [(e.token_count, e.backend) for e in entries]
    assert ranks == sorted(ranks, reverse=True)
    assert len({e.backend for e in entries}) == len(entries)


class FakeClock:
    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def new_key_prefix() -> str:
    """A key prefix of this test's own: parallel runs never collide."""
    return f"test:{uuid.uuid4().hex[:12]}:kvidx:"


async def delete_prefix(client: RedisClient, key_prefix: str) -> None:
    """Every key of an index under ``key_prefix``: ``<kp>...`` and, on a Cluster, the
    per-backend ``{<kp><backend>}...``."""
    for match in (key_prefix + "*", "{" + key_prefix + "*"):
        keys = [k async for page in scan_pages(client, match, 500) for k in page]
        await unlink(client, keys)
