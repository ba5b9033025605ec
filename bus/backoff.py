"""Reconnect delays as an injected strategy.

A source's supervisor loop counts consecutive failures and asks its strategy how long to
wait before the next attempt; it calls ``reset()`` once a connection has proved healthy.
Production code uses :class:`ExponentialBackoff`; tests inject :class:`NoBackoff` (or their
own recording strategy), so nothing in a test sleeps on a timer.
"""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

__all__ = ["Backoff", "ExponentialBackoff", "NoBackoff"]


@runtime_checkable
class Backoff(Protocol):
    """A reconnect-delay strategy."""

    def compute(self, failures: int) -> float:
        """Seconds to wait after ``failures`` consecutive failures (``failures >= 1``)."""
        ...

    def reset(self) -> None:
        """Forget any state; called when a connection has become healthy again."""
        ...


class ExponentialBackoff:
    """``base_s * 2**(failures-1)``, capped at ``cap_s``, minus up to ``jitter`` of itself.

    Args:
        base_s: delay after the first failure, in seconds (> 0).
        cap_s: largest delay, in seconds (>= ``base_s``).
        jitter: fraction in ``[0, 1]``; the delay is scaled by a uniform factor in
            ``[1 - jitter, 1]`` so that many sources restarting together spread out. The cap
            is never exceeded.
        rng: random source (inject a seeded ``random.Random`` for reproducible delays).
    """

    __slots__ = ("_rng", "base_s", "cap_s", "jitter")

    def __init__(
        self,
        base_s: float = 0.5,
        cap_s: float = 30.0,
        jitter: float = 0.2,
        *,
        rng: random.Random | None = None,
    ) -> None:
        if not base_s > 0:
            raise ValueError(f"base_s must be > 0, got {base_s!r}")
        if not cap_s >= base_s:
            raise ValueError(f"cap_s ({cap_s!r}) must be >= base_s ({base_s!r})")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be within [0, 1], got {jitter!r}")
        self.base_s = float(base_s)
        self.cap_s = float(cap_s)
        self.jitter = float(jitter)
        self._rng = rng or random.Random()

    def compute(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        # Cap the exponent first: 2**1000 floats overflow long before the cap applies.
        delay = min(self.cap_s, self.base_s * 2.0 ** min(failures - 1, 62))
        if self.jitter:
            delay -= delay * self.jitter * self._rng.random()
        return delay

    def reset(self) -> None:
        """Stateless: the delay depends only on ``failures``. Idempotent."""

    def __repr__(self) -> str:
        return f"ExponentialBackoff(base_s={self.base_s}, cap_s={self.cap_s}, jitter={self.jitter})"


class NoBackoff:
    """Always 0 s: reconnect at once (tests). Counts calls so tests can assert on them."""

    __slots__ = ("computed", "resets")

    def __init__(self) -> None:
        self.computed: list[int] = []
        """The ``failures`` argument of every ``compute`` call, in order."""
        self.resets = 0

    def compute(self, failures: int) -> float:
        self.computed.append(failures)
        return 0.0

    def reset(self) -> None:
        self.resets += 1
