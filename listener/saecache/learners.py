"""The online learners of SAECache: every parameter of the priority is fitted from traffic.

Each learner is a small accumulator with an ``update`` step called once per window of
block accesses; each can be frozen (``learn=False``) so its current value stays fixed.

* ``LogNormalMle`` — maximum-likelihood log-normal fit of re-access intervals:
  ``mu = mean(ln x)``, ``sigma = sqrt(mean(ln x)^2 - mu^2)`` (the MLE, divisor n). Sums are
  exponentially decayed with a half-life in samples so the fit follows a workload shift;
  ``halflife=None`` keeps every sample (the exact batch MLE).
* ``EmpiricalGaps`` — the same intervals as a decayed histogram of ``ln x`` (96 bins
  from 1 ms to 10^6 s), from which the survival and the expected residual wait are read
  without assuming a family.
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

__all__ = [
    "ContinuationFit",
    "EmpiricalGaps",
    "GammaFit",
    "LogNormalMle",
    "alive",
    "ema_weights",
    "softmax_weights",
]

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


def alive(p: float, surv: float, cont: bool) -> float:
    """The probability that a session idle with survival ``surv`` is still alive: ``p S /
    (p S + 1 - p)`` with ``cont`` (``p`` its learned continuation), else ``S``; floored
    above zero so a priority never divides to nothing."""
    if cont:
        a = p * surv
        a = a / (a + 1.0 - p) if a > 0.0 else 0.0
    else:
        a = surv
    return a if a > 1e-300 else 1e-300


class EmpiricalGaps:
    """The gap distribution as a decayed histogram of ``ln x`` (no family assumed): the
    survival ``S(dt)`` and the expected wait ``max(E[X], E[X - dt | X > dt])`` read from
    tables that :meth:`refresh` rebuilds (once per window), interpolated in ``ln dt``.

    The wait table is made non-decreasing (a running maximum): the priority's time part
    must only fall as ``dt`` grows, or a list's oldest block would stop being its lowest
    (``policy``); a distribution whose residual wait shrinks past some age (light tails,
    a second mode) is priced at its largest wait so far, the conservative side. Until
    ``min_samples`` gaps are in, :attr:`ready` is False and the caller keeps its
    parametric fit.
    """

    __slots__ = ("_decay", "_g", "_min", "counts", "learn", "n", "ready", "surv", "wait")

    LO, HI, BINS = math.log(1e-3), math.log(1e6), 96
    """Bin edges: ``BINS`` equal steps of ``ln x`` from 1 ms to 10^6 s; gaps outside go to
    the end bins."""

    def __init__(
        self, *, halflife: float | None = 2000.0, learn: bool = True, min_samples: int = 64
    ) -> None:
        self.learn = learn
        self._decay = 1.0 if halflife is None else 0.5 ** (1.0 / halflife)
        self._min = min_samples
        self._g = 1.0
        self.n = 0.0
        """Samples, decayed."""
        self.counts = [0.0] * self.BINS
        self.ready = False
        self.surv: list[float] = []
        """``S`` at every bin edge (``BINS + 1`` values, 1 at the first)."""
        self.wait: list[float] = []
        """The expected wait at every bin edge, non-decreasing."""

    def observe(self, interval: float) -> None:
        if interval <= 0 or not self.learn:
            return
        k = int((math.log(interval) - self.LO) / (self.HI - self.LO) * self.BINS)
        k = 0 if k < 0 else self.BINS - 1 if k >= self.BINS else k
        # decayed counts without touching every bin: each new sample weighs 1/d more
        # than the one before it (rescaled before it overflows)
        self._g /= self._decay
        if self._g > 1e200:
            self.counts = [c / self._g for c in self.counts]
            self._g = 1.0
        self.counts[k] += self._g
        self.n = self.n * self._decay + 1.0

    def refresh(self) -> None:
        """Rebuild the tables from the counts (every sample weighs its bin's midpoint)."""
        total = sum(self.counts)
        if total <= 0 or self.n < self._min:
            return
        nb, lo, step = self.BINS, self.LO, (self.HI - self.LO) / self.BINS
        edges = [math.exp(lo + k * step) for k in range(nb + 1)]
        mids = [math.exp(lo + (k + 0.5) * step) for k in range(nb)]
        surv = [0.0] * (nb + 1)
        tail_mass = tail_sum = 0.0
        after = [0.0] * (nb + 1)  # sum of x over samples beyond each edge
        for k in range(nb - 1, -1, -1):
            tail_mass += self.counts[k]
            tail_sum += self.counts[k] * mids[k]
            surv[k] = tail_mass / total
            after[k] = tail_sum
        mean = tail_sum / total
        wait = [0.0] * (nb + 1)
        best = mean
        for k in range(nb + 1):
            mass = surv[k] * total
            if mass > 1e-9:
                r = after[k] / mass - edges[k]
                if r > best:
                    best = r
            elif edges[k] > best:
                best = edges[k]
            wait[k] = best
        self.surv, self.wait, self.ready = surv, wait, True

    def _at(self, dt: float) -> tuple[float, float]:
        """``(S, wait)`` after ``dt`` idle, interpolated between bin edges in ``ln dt``."""
        x = (math.log(dt) - self.LO) / (self.HI - self.LO) * self.BINS
        if x <= 0.0:
            return self.surv[0], self.wait[0]
        if x >= self.BINS:
            return self.surv[-1], max(self.wait[-1], dt)
        k = int(x)
        f = x - k
        surv, wait = self.surv, self.wait
        return surv[k] + (surv[k + 1] - surv[k]) * f, wait[k] + (wait[k + 1] - wait[k]) * f

    def wait_at(self, dt: float) -> float:
        """The expected wait after ``dt`` idle (non-decreasing in ``dt``)."""
        return self._at(dt)[1]

    def factor(self, p: float, dt: float, cont: bool, resid: bool) -> float:
        """``p_q(dt) / D(dt)`` as ``policy._time_factor`` computes it from a log-normal."""
        surv, wait = self._at(dt)
        return alive(p, surv, cont) / (wait if resid else dt)


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
