"""Admin JSON documents, shaped exactly as the reference documentation shows them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Router

__all__ = ["gemini_context_cache_stats", "prefix_routing_stats"]


def prefix_routing_stats(router: Router) -> dict[str, Any]:
    """GET /admin/prefix-routing/stats. ``overflow_rate`` is a string with 4 decimals."""
    pr = router.config.prefix_routing
    counts = router.selector.counts
    total = counts.total
    return {
        "enabled": pr.enabled,
        "config": {
            "max_prefix_length": pr.max_prefix_length,
            "load_factor_epsilon": pr.load_factor_epsilon,
            "virtual_nodes": pr.virtual_nodes,
            "anthropic_cache_control_injection": pr.anthropic_cache_control_injection,
        },
        "routing_decisions": {
            "total": total,
            "prefix_hash": counts.prefix_hash,
            "overflow": counts.overflow,
            "fallback": counts.fallback,
            "overflow_rate": f"{(counts.overflow / total) if total else 0.0:.4f}",
        },
        "backend_distribution": [
            {"backend": b.name, "in_flight_requests": b.in_flight} for b in router.pool.backends
        ],
        "unique_prefixes": counts.unique.count(),
    }


def gemini_context_cache_stats(router: Router) -> dict[str, Any]:
    """GET /admin/gemini-context-cache/stats: the same shape whether enabled or not."""
    cache = router.gemini.cache if router.gemini is not None else None
    if cache is not None:
        return cache.stats()
    from .gemini.manager import Counters

    return {
        "enabled": False,
        "config": router.config.gemini_context_cache.model_dump(),
        "entries": 0,
        "negative_entries": 0,
        "in_flight": 0,
        "backends": {},
        "counters": Counters().as_dict(),
    }
