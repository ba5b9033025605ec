"""Consistent hash ring with bounded loads (CHWBL; Mirrokni, Thorup, Zadimoghaddam 2018).

Each backend owns ``virtual_nodes`` points on a 64-bit ring, at
``SHA256(name ++ "#" ++ i)[:8]`` so every router instance builds the same ring. A key's
position is the first 8 bytes of its digest (prefix keys are already SHA-256).

Bounded lookup: with ``n`` candidates carrying ``total`` requests in flight, the cap is
``ceil((1 + epsilon) * (total + 1) / n)`` (the new request counted). Walking clockwise
from the key, the first candidate point is the *owner*; the first candidate whose
in-flight count is below the cap wins. Owner wins → ``prefix_hash``; a later backend →
``overflow``. If every candidate is at the cap (impossible with the formula above while
loads are only changed by this router, but possible with concurrent updates), the owner
is kept so prefix locality survives overload.

Unbounded lookup (no prefix key: the model name is hashed): the first candidate point.

Points of backends that are not candidates for this request (unhealthy, another model)
are skipped, which is what makes membership changes move only the affected keys.
Lookup is O(log P) for the bisect plus the clockwise steps, P = points on the ring.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Literal, Protocol

__all__ = ["HashRing", "RingMember", "key_position", "point_position"]

Decision = Literal["prefix_hash", "overflow", "fallback"]


class RingMember(Protocol):
    name: str
    index: int
    in_flight: int


def point_position(name: str, i: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}#{i}".encode()).digest()[:8], "big")


def key_position(digest: bytes) -> int:
    """Ring position of a SHA-256 digest (a prefix key, or a hashed model name)."""
    return int.from_bytes(digest[:8], "big")


class HashRing:
    """An immutable ring over ``members``; rebuild it on membership or vnode changes."""

    __slots__ = ("_members", "_owners", "_points", "virtual_nodes")

    def __init__(self, members: Sequence[RingMember], virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        pts: list[tuple[int, str, int]] = []
        for m in members:
            for i in range(virtual_nodes):
                pts.append((point_position(m.name, i), m.name, i))
        pts.sort()
        by_name = {m.name: m for m in members}
        self._points = [p for p, _, _ in pts]
        self._owners = [by_name[name] for _, name, _ in pts]
        self._members = tuple(members)

    def __len__(self) -> int:
        return len(self._points)

    def owner(self, position: int, mask: int) -> RingMember | None:
        """First member clockwise from ``position`` whose bit is set in ``mask``."""
        points = self._points
        n = len(points)
        if n == 0 or mask == 0:
            return None
        owners = self._owners
        start = bisect_left(points, position)
        for step in range(n):
            m = owners[(start + step) % n]
            if (mask >> m.index) & 1:
                return m
        return None

    def bounded(
        self,
        position: int,
        candidates: Sequence[RingMember],
        mask: int,
        epsilon: float,
    ) -> tuple[RingMember | None, Decision]:
        """The CHWBL choice among ``candidates`` (whose bits form ``mask``)."""
        points = self._points
        n = len(points)
        if n == 0 or mask == 0:
            return None, "prefix_hash"
        total = 0
        for c in candidates:
            total += c.in_flight
        cap = math.ceil((1.0 + epsilon) * (total + 1) / len(candidates))
        owners = self._owners
        start = bisect_left(points, position)
        owner: RingMember | None = None
        visited = 0
        for step in range(n):
            m = owners[(start + step) % n]
            bit = 1 << m.index
            if not mask & bit or visited & bit:
                continue
            if owner is None:
                owner = m
            if m.in_flight < cap:
                return m, ("prefix_hash" if m is owner else "overflow")
            visited |= bit
            if visited == mask:
                break
        return owner, "prefix_hash"
