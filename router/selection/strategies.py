"""The six selection strategies, one class each, behind one small interface.

A strategy picks one backend from a non-empty candidate tuple. It never sees the
scorer: ``Selector`` (``selector.py``) runs the KV overlap scorer first and only asks
the strategy when the scorer declines.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..kvindex.cost import ChainView, RequestChain
from ..pool import Backend
from .ring import HashRing, key_position

__all__ = [
    "STRATEGY_CLASSES",
    "ConsistentHash",
    "LeastLatency",
    "PrefixAwareHash",
    "RandomChoice",
    "RoundRobin",
    "SelectionContext",
    "Strategy",
    "WeightedRoundRobin",
]


@dataclass(slots=True)
class SelectionContext:
    """What a strategy may look at for one request."""

    model: str
    prefix_key: bytes | None = None
    affinity: str | None = None
    """Session-affinity key for ConsistentHash (``x-session-id`` header or ``user``)."""
    chain: RequestChain | None = None
    """The request's prompt chain (conversation-depth routing), when it could be rendered."""
    view: ChainView | None = None
    """The chain against the chain index, set by the selector when it assessed it: what
    the forwarder's prefill and accuracy accounting read for the chosen backend."""


class Strategy(Protocol):
    name: str

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        """Pick one of ``candidates`` (non-empty; ``mask`` has their index bits)."""
        ...


class RoundRobin:
    name = "RoundRobin"

    def __init__(self) -> None:
        self._n = 0

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        self._n += 1
        return candidates[self._n % len(candidates)]


class WeightedRoundRobin:
    """nginx's smooth weighted round robin: spreads a heavy backend's turns evenly."""

    name = "WeightedRoundRobin"

    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        current = self._current
        total = 0
        best: Backend | None = None
        best_w = 0
        for b in candidates:
            w = b.config.weight
            total += w
            cw = current.get(b.name, 0) + w
            current[b.name] = cw
            if best is None or cw > best_w:
                best, best_w = b, cw
        assert best is not None
        current[best.name] = best_w - total
        return best


class LeastLatency:
    """Lowest EWMA of time-to-response-headers; a backend with no sample goes first."""

    name = "LeastLatency"

    def __init__(self) -> None:
        self._n = 0

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        self._n += 1
        k = len(candidates)
        best = candidates[self._n % k]  # rotate the start so ties spread
        best_l = best.latency_ewma if best.latency_samples else -1.0
        for i in range(k):
            b = candidates[(self._n + i) % k]
            lat = b.latency_ewma if b.latency_samples else -1.0
            if lat < best_l:
                best, best_l = b, lat
        return best


class RandomChoice:
    name = "Random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        return candidates[self._rng.randrange(len(candidates))]


_model_positions: dict[str, int] = {}


def model_position(model: str) -> int:
    pos = _model_positions.get(model)
    if pos is None:
        pos = key_position(hashlib.sha256(model.encode("utf-8", "surrogatepass")).digest())
        if len(_model_positions) > 10_000:
            _model_positions.clear()
        _model_positions[model] = pos
    return pos


class _RingStrategy:
    """Shared ring ownership: rebuilt by the Selector when members or vnodes change."""

    def __init__(self, ring: HashRing) -> None:
        self.ring = ring


class ConsistentHash(_RingStrategy):
    """Plain consistent hashing, no load bound: session affinity, else prefix, else model."""

    name = "ConsistentHash"

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        if ctx.affinity is not None:
            pos = key_position(
                hashlib.sha256(ctx.affinity.encode("utf-8", "surrogatepass")).digest()
            )
        elif ctx.prefix_key is not None:
            pos = key_position(ctx.prefix_key)
        else:
            pos = model_position(ctx.model)
        owner = self.ring.owner(pos, mask)
        return owner if owner is not None else candidates[0]  # type: ignore[return-value]


class PrefixAwareHash(_RingStrategy):
    """Tier 1: CHWBL over the prefix key; the model name, unbounded, without one."""

    name = "PrefixAwareHash"

    def __init__(
        self,
        ring: HashRing,
        epsilon: float,
        on_decision: Callable[[str, Backend, SelectionContext], None] | None = None,
    ) -> None:
        super().__init__(ring)
        self.epsilon = epsilon
        self.on_decision = on_decision

    def select(self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext) -> Backend:
        if ctx.prefix_key is None:
            owner = self.ring.owner(model_position(ctx.model), mask)
            chosen, decision = (owner if owner is not None else candidates[0]), "fallback"
        else:
            picked, decision = self.ring.bounded(
                key_position(ctx.prefix_key), candidates, mask, self.epsilon
            )
            chosen = picked if picked is not None else candidates[0]
        if self.on_decision is not None:
            self.on_decision(decision, chosen, ctx)  # type: ignore[arg-type]
        return chosen  # type: ignore[return-value]


STRATEGY_CLASSES = {
    "RoundRobin": RoundRobin,
    "WeightedRoundRobin": WeightedRoundRobin,
    "LeastLatency": LeastLatency,
    "Random": RandomChoice,
    "ConsistentHash": ConsistentHash,
    "PrefixAwareHash": PrefixAwareHash,
}
