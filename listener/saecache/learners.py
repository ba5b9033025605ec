"""The online learners of SAECache: every parameter of the priority is fitted from traffic.

Each learner is a small accumulator with an ``update`` step called once per window of
block accesses; each can be frozen (``learn=False``) so its current value stays fixed.

* ``LogNormalMle`` — maximum-likelihood log-normal fit of re-access intervals:
  ``mu = mean(ln x)``, ``sigma = sqrt(mean(ln x)^2 - mu^2)`` (the MLE, divisor n). Sums are
  exponentially decayed with a half-life in samples so the fit follows a workload shift;
  ``halflife=None`` keeps every sample (the exact batch MLE).
* ``GammaFit`` — the positional decay exponent. Per offset bucket the would-hit rate
  ``h`` (hits plus misses on recently evicted blocks, over accesses) is modelled as
  ``h(o) = 1 - (o / o_max)^gamma``, i.e. ``ln(1 - h) = gamma * ln(o / o_max)``; gamma is
  the least-squares slope through the origin of that log-log relation.
* ``ema_weights`` — token-type weights: per type the reuse rate of the window,
  ``(hits + evicted-then-missed) / accesses``, normalised by the largest, smoothed by EMA.
* ``ContinuationFit`` — the probability that a session sends another request, per
  feature cell of its latest request (see ``policy``): decayed counts of requests
  followed by another one of the same session, over requests whose outcome is known
  (the session came back, or stayed idle past a high quantile of its gap distribution),
  with a prior of ``prior_weight`` pseudo-requests at ``prior``.
* ``softmax_weights`` — queue weights: hit blocks per resident block of each queue,
  normalised by the largest, passed through a softmax with a temperature and scaled so the
  weights average 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["ContinuationFit", "GammaFit", "LogNormalMle", "ema_weights", "softmax_weights"]

_SQRT2 = math.sqrt(2.0)


class LogNormalMle:
    """Online (optionally decayed) log-normal MLE; ``survival`` is ``1 - F_LN(dt)``."""

    __slots__ = ("_decay", "_min", "learn", "mu", "n", "s1", "s2", "sigma")

    def __init__(
        self,
        mu: float,
        sigma: float,
        *,
        halflife: float | None = 2000.0,
        learn: bool = True,
        min_samples: int = 16,
    ) -> None:
        if sigma <= 0:
            raise ValueError("sigma must be positive")
        self.mu, self.sigma, self.learn = mu, sigma, learn
        self._decay = 1.0 if halflife is None else 0.5 ** (1.0 / halflife)
        self.n = self.s1 = self.s2 = 0.0
        self._min = min_samples

    def observe(self, interval: float) -> None:
        """Add one re-access interval (seconds, > 0); non-positive ones are ignored."""
        if interval <= 0 or not self.learn:
            return
        x = math.log(interval)
        d = self._decay
        self.n = self.n * d + 1.0
        self.s1 = self.s1 * d + x
        self.s2 = self.s2 * d + x * x
        if self.n >= self._min:
            self.fit()

    def fit(self) -> None:
        if self.n <= 0:
            return
        mu = self.s1 / self.n
        var = self.s2 / self.n - mu * mu
        self.mu = mu
        self.sigma = math.sqrt(var) if var > 1e-6 else 1e-3

    def survival(self, dt: float) -> float:
        """``1 - F_LN(dt; mu, sigma)``."""
        if dt <= 0:
            return 1.0
        return 0.5 * math.erfc((math.log(dt) - self.mu) / (self.sigma * _SQRT2))


class ContinuationFit:
    """P(another request | cell of the latest one), from resolved outcomes (see module doc)."""

    __slots__ = (
        "_decay",
        "_t",
        "c",
        "init",
        "learn",
        "n",
        "prior",
        "prior_weight",
        "ps",
        "stamp",
    )

    def __init__(
        self,
        cells: int,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        halflife: float | None = 2000.0,
        learn: bool = True,
        init: dict[int, float] | None = None,
    ) -> None:
        self.prior, self.prior_weight, self.learn = prior, prior_weight, learn
        self._decay = 1.0 if halflife is None else 0.5 ** (1.0 / halflife)
        self.n = [0.0] * cells
        self.c = [0.0] * cells
        self.stamp = [0] * cells
        self._t = 0
        self.init = [prior] * cells
        for k, v in (init or {}).items():
            if 0 <= k < cells:
                self.init[k] = min(max(v, 0.0), 1.0)
        self.ps = [self._estimate(k) for k in range(cells)]  # current p per cell

    def observe(self, cell: int, continued: bool, *, count: bool = True) -> None:
        """One resolved request of ``cell``; ``count=False`` adds a late continuation only
        (its request was already counted as ended)."""
        if not self.learn:
            return
        self._t += 1
        d = self._decay ** (self._t - self.stamp[cell])
        self.stamp[cell] = self._t
        self.n[cell] = self.n[cell] * d + (1.0 if count else 0.0)
        self.c[cell] = self.c[cell] * d + (1.0 if continued else 0.0)
        self.ps[cell] = self._estimate(cell)

    def p(self, cell: int) -> float:
        return self.ps[cell]

    def _estimate(self, cell: int) -> float:
        w = self.prior_weight
        n = self.n[cell]
        return min((self.c[cell] + w * self.init[cell]) / (n + w), 1.0) if n + w > 0 else 1.0

    def table(self) -> dict[int, float]:
        """The current estimate of every cell with data or a given start (``SaeParams``)."""
        return {
            k: self.ps[k]
            for k in range(len(self.n))
            if self.n[k] > 0 or self.c[k] > 0 or self.init[k] != self.prior
        }


class GammaFit:
    """Positional decay exponent from per-offset-bucket would-hit rates (see module doc)."""

    def __init__(
        self, gamma: float = 1.0, *, learn: bool = True, ema: float = 0.3, min_count: int = 32
    ) -> None:
        self.gamma, self.learn, self.ema, self.min_count = gamma, learn, ema, min_count
        self.acc: dict[int, float] = {}
        self.reuse: dict[int, float] = {}

    def observe(self, bucket: int, reused: bool) -> None:
        if not self.learn:
            return
        self.acc[bucket] = self.acc.get(bucket, 0.0) + 1.0
        if reused:
            self.reuse[bucket] = self.reuse.get(bucket, 0.0) + 1.0

    def update(self, rep: Sequence[float], o_max: float, decay: float = 0.5) -> float | None:
        """Refit gamma from the buckets' counts; returns the raw fit (None: not enough data).

        ``rep[k]`` is the representative offset of bucket ``k``; counts are then decayed.
        """
        if not self.learn:
            return None
        sxy = sxx = 0.0
        for k, a in self.acc.items():
            if a < self.min_count or k == 0:
                continue
            ratio = min(rep[k] / o_max, 0.999)
            h = self.reuse.get(k, 0.0) / a
            x = math.log(ratio)
            y = math.log(max(1.0 - h, 0.5 / a))  # half a miss: no log(0) on a full bucket
            sxy += x * y
            sxx += x * x
        for k in self.acc:
            self.acc[k] *= decay
        for k in self.reuse:
            self.reuse[k] *= decay
        if sxx <= 0:
            return None
        raw = min(max(sxy / sxx, 0.1), 10.0)
        self.gamma += self.ema * (raw - self.gamma)
        return raw


def ema_weights(
    current: Sequence[float],
    accesses: Sequence[float],
    reused: Sequence[float],
    *,
    ema: float,
    floor: float,
    min_accesses: float = 32.0,
) -> list[float]:
    """Token-type weights: EMA towards each type's reuse rate over the largest one."""
    rates = [r / a if a >= min_accesses else None for a, r in zip(accesses, reused, strict=True)]
    top = max((r for r in rates if r is not None), default=0.0)
    if top <= 0:
        return list(current)
    out = []
    for w, r in zip(current, rates, strict=True):
        if r is None:
            out.append(w)
        else:
            out.append(max(floor, w + ema * (r / top - w)))
    return out


def softmax_weights(
    current: Sequence[float],
    hits: Sequence[float],
    resident: Sequence[float],
    *,
    temperature: float,
    ema: float,
) -> list[float]:
    """Queue weights from hit blocks per resident block, temperature-scaled softmax.

    Queues that held nothing in the window keep their weight.
    """
    eff = [h / r if r > 0 else None for h, r in zip(hits, resident, strict=True)]
    live = [e for e in eff if e is not None]
    top = max(live, default=0.0)
    if top <= 0 or temperature <= 0:
        return list(current)
    exps = [math.exp(e / top / temperature) if e is not None else None for e in eff]
    total = sum(x for x in exps if x is not None)
    n = len(live)
    out = []
    for w, x in zip(current, exps, strict=True):
        out.append(w if x is None else w + ema * (n * x / total - w))
    return out
