"""In-flight requests per backend, averaged over a time window, for the conversation scorer.

The scorer's load term and its bounded-load cap read these averages. The cap keeps a
shared prompt's sessions from piling onto the one engine that holds it. Against
instantaneous in-flight counts it fires on every burst: a few sessions of a popular prompt
arriving together put its engine at the cap for a moment, and each request sent past it
prefills the whole prompt on an engine that does not hold it (and, predicted there,
starts a second copy). What the cap is for is a *lasting* imbalance. The same holds for
the load term: when two engines hold a prompt, instantaneous counts flip its choice every
few requests and the prompt ends up split over both. So both read exponentially weighted
averages with time constant ``window`` seconds: ``avg += (1 - exp(-dt / window)) *
(count - avg)``, with the count seen at the previous sample (it held since then, as far as
the sampler knows), sampled at each decision, each backend with its own sample times
since candidate sets differ between models.

A backend seen for the first time starts at its current count, and until a window has
passed since then the count now fills the part of the window not yet seen (a router that
starts into a burst caps it as the instantaneous counts would). ``window == 0`` gives the
instantaneous counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..pool import Backend

__all__ = ["LoadAverage", "RecentCount"]


class LoadAverage:
    """Exponentially weighted in-flight counts per backend name (module docstring)."""

    __slots__ = ("_clock", "_state", "window")

    def __init__(self, window: float, clock: Callable[[], float]) -> None:
        self.window = window
        self._clock = clock
        self._state: dict[str, tuple[float, float, float, int]] = {}
        """name -> (average, time of its last sample, time of its first, the count then)."""

    def sample(self, candidates: Sequence[Backend]) -> list[float]:
        """Fold every candidate's current in-flight count into its average and return the
        averages, in the candidates' order."""
        if self.window <= 0:
            return [float(b.in_flight) for b in candidates]
        now = self._clock()
        state = self._state
        window = self.window
        out = []
        for b in candidates:
            count = b.in_flight
            prev = state.get(b.name)
            if prev is None:
                avg, first = float(count), now
            else:
                # The count seen at the last sample held until now (as far as we know):
                # a count that just rose weighs only from here on.
                avg, then, first, last = prev
                dt = now - then
                if dt > 0:
                    avg += (1.0 - math.exp(-dt / window)) * (last - avg)
            state[b.name] = (avg, now, first, count)
            # Until a window has passed since the first sample the average covers only
            # part of one: the count now stands in for the rest.
            w = 1.0 - math.exp(-(now - first) / window)
            out.append(w * avg + (1.0 - w) * count)
        return out

    def value(self, backend: Backend) -> float:
        """``backend``'s average at its last sample (its current count if never sampled,
        or with ``window == 0``)."""
        state = self._state.get(backend.name)
        if state is None or self.window <= 0:
            return float(backend.in_flight)
        avg, then, first, _ = state
        w = 1.0 - math.exp(-(then - first) / self.window)
        return w * avg + (1.0 - w) * backend.in_flight

    def snapshot(self) -> dict[str, float]:
        """Each backend's average at its last sample (admin stats)."""
        return {name: round(avg, 3) for name, (avg, *_) in self._state.items()}


class RecentCount:
    """Events per backend name, each weighing ``exp(-age / window)``: how many prompts
    were placed on a backend lately, which its load does not show yet (a prompt placed a
    moment ago has sent one request; its sessions follow)."""

    __slots__ = ("_clock", "_state", "window")

    def __init__(self, window: float, clock: Callable[[], float]) -> None:
        self.window = window
        self._clock = clock
        self._state: dict[str, tuple[float, float]] = {}
        """name -> (decayed count, time it was computed)."""

    def value(self, name: str) -> float:
        state = self._state.get(name)
        if state is None:
            return 0.0
        count, then = state
        if self.window <= 0:
            return count
        return count * math.exp(-max(0.0, self._clock() - then) / self.window)

    def add(self, name: str) -> None:
        self._state[name] = (self.value(name) + 1.0, self._clock())
