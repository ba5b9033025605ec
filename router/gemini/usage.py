"""Token accounting for Gemini answers: one cached-input bucket, whatever made the hit.

A hit on a router-managed cachedContents resource and a hit from Gemini's implicit
caching (reported in ``usageMetadata.cachedContentTokenCount``, with no setup) are
counted the same way. Gemini's ``promptTokenCount`` already includes the cached tokens,
so each API keeps its own convention:

* OpenAI chat completions: ``prompt_tokens`` stays the whole prompt and
  ``usage.prompt_tokens_details.cached_tokens`` says how much of it was cached;
* Anthropic Messages: ``input_tokens`` excludes cache reads, which are reported as
  ``cache_read_input_tokens``;
* usage records (limits, budgets): ``input_tokens = prompt_tokens - cached`` is what is
  charged as fresh input, and the cached part is ``cached_input_tokens`` with
  ``cache_hit: true``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "UsageRecord",
    "anthropic_usage",
    "cached_tokens_of",
    "fill_cached_tokens",
    "openai_usage",
]


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def openai_usage(meta: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI ``usage`` from a Gemini ``usageMetadata`` object."""
    prompt = _count(meta.get("promptTokenCount")) + _count(meta.get("toolUsePromptTokenCount"))
    thoughts = _count(meta.get("thoughtsTokenCount"))
    completion = _count(meta.get("candidatesTokenCount")) + thoughts
    total = _count(meta.get("totalTokenCount")) or prompt + completion
    cached = min(_count(meta.get("cachedContentTokenCount")), prompt)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if thoughts:
        usage["completion_tokens_details"] = {"reasoning_tokens": thoughts}
    return usage


def cached_tokens_of(usage: Mapping[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    return _count(details.get("cached_tokens")) if isinstance(details, Mapping) else 0


def fill_cached_tokens(usage: dict[str, Any], cached: int) -> None:
    """Make ``prompt_tokens_details.cached_tokens`` present on an OpenAI usage object.

    ``cached`` is what the router knows was served from its cache reference (the
    resource's token count); a count the backend reported itself wins. Never more than
    ``prompt_tokens``.
    """
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    reported = _count(details.get("cached_tokens"))
    value = reported or cached
    prompt = _count(usage.get("prompt_tokens"))
    details["cached_tokens"] = min(value, prompt) if prompt else value


def anthropic_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    """Anthropic Messages ``usage``: cache reads are not part of ``input_tokens``."""
    cached = min(max(cached, 0), max(prompt_tokens, 0))
    return {
        "input_tokens": max(prompt_tokens, 0) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": max(output_tokens, 0),
    }


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One answered request's tokens, as limits and budgets should charge them."""

    backend: str
    model: str
    prompt_tokens: int
    input_tokens: int
    """Fresh (uncached) input: ``prompt_tokens - cached_input_tokens``."""
    cached_input_tokens: int
    output_tokens: int
    cache_hit: bool

    @classmethod
    def from_openai(cls, backend: str, model: str, usage: Mapping[str, Any]) -> UsageRecord:
        prompt = _count(usage.get("prompt_tokens"))
        cached = min(cached_tokens_of(usage), prompt)
        return cls(
            backend,
            model,
            prompt,
            prompt - cached,
            cached,
            _count(usage.get("completion_tokens")),
            cached > 0,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
