"""Prometheus view of the Gemini context cache and of Gemini usage records.

Read at scrape time from the live objects (no per-request metric calls). Label values are
configured backend names only. There are no per-key limits or budgets in the router yet,
so usage records are kept as totals here: ``input_tokens`` (fresh input, what a limit
would charge) and ``cached_input_tokens`` apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .manager import Counters, GeminiContextCache
from .usage import UsageRecord

__all__ = ["GeminiCollector", "UsageTotals"]

_PREFIX = "continuum_gemini_context_cache_"
_HELP = {
    "hit": "Eligible requests sent with a live cachedContents reference.",
    "miss": "Eligible requests with no entry (forwarded whole; a create started).",
    "ineligible": "Requests to gemini backends not eligible (small or no system prompt, tools).",
    "negative": "Eligible requests whose prefix is in the negative cache.",
    "creates": "cachedContents resources created.",
    "create_failures": "cachedContents creates rejected or failed.",
    "evictions": "Entries evicted over max_entries (live ones deleted remotely).",
    "cached_tokens": "Prompt tokens served from a cache (router-managed or implicit).",
    "extends": "Resource ttls extended on a hit.",
    "stale": "References the backend no longer knew (expired or deleted), retried without.",
}


@dataclass(slots=True)
class _Usage:
    requests: int = 0
    cache_hits: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0


class UsageTotals:
    """Sums of usage records per backend; ``add`` is the service's usage sink."""

    def __init__(self) -> None:
        self.by_backend: dict[str, _Usage] = {}

    def add(self, rec: UsageRecord) -> None:
        u = self.by_backend.get(rec.backend)
        if u is None:
            u = self.by_backend[rec.backend] = _Usage()
        u.requests += 1
        u.cache_hits += 1 if rec.cache_hit else 0
        u.input_tokens += rec.input_tokens
        u.cached_input_tokens += rec.cached_input_tokens
        u.output_tokens += rec.output_tokens


class GeminiCollector(Collector):
    def __init__(self, cache: Callable[[], GeminiContextCache | None], usage: UsageTotals) -> None:
        self._cache = cache
        self._usage = usage

    def collect(self) -> Iterator[Any]:
        cache = self._cache()
        if cache is not None:
            families = {
                name: CounterMetricFamily(_PREFIX + name, text, labels=["backend"])
                for name, text in _HELP.items()
            }
            for backend, c in sorted(cache.per_backend.items()):
                values = c.as_dict()
                for name, fam in families.items():
                    fam.add_metric([backend], values[name])
            if not cache.per_backend:
                zero = Counters().as_dict()
                for name, fam in families.items():
                    fam.add_metric(["none"], zero[name])
            yield from families.values()
            yield GaugeMetricFamily(
                _PREFIX + "entries", "Live cachedContents entries tracked.", cache.map.live_count
            )
            yield GaugeMetricFamily(
                _PREFIX + "negative_entries",
                "Prefixes in the negative cache.",
                cache.map.negatives,
            )
            yield GaugeMetricFamily(
                _PREFIX + "in_flight_creates", "Creates in progress.", cache.in_flight
            )
        tokens = CounterMetricFamily(
            "continuum_gemini_usage_tokens",
            "Tokens of gemini answers: kind=input (fresh, charged to limits), "
            "cached_input, output.",
            labels=["backend", "kind"],
        )
        requests = CounterMetricFamily(
            "continuum_gemini_usage_requests",
            "Answered gemini chat completions by whether part of the prompt was cached.",
            labels=["backend", "cache_hit"],
        )
        for backend, u in sorted(self._usage.by_backend.items()):
            tokens.add_metric([backend, "input"], u.input_tokens)
            tokens.add_metric([backend, "cached_input"], u.cached_input_tokens)
            tokens.add_metric([backend, "output"], u.output_tokens)
            requests.add_metric([backend, "true"], u.cache_hits)
            requests.add_metric([backend, "false"], u.requests - u.cache_hits)
        yield tokens
        yield requests
