"""Gemini backends: the router-managed context cache, the native API, usage accounting.

Modules: ``api`` (wire details of the Generative Language API), ``entries`` (the LRU map
of live and rejected prefixes), ``manager`` (the cachedContents lifecycle, single-flight
creates), ``native`` (OpenAI chat completions to generateContent and back), ``usage``
(cached-token accounting), ``anthropic`` (Anthropic Messages to generateContent and
back), ``chat`` (the per-request hooks the proxy calls), ``metrics`` (Prometheus
collector).
"""

from .chat import GeminiChat, GeminiService, TranslationError
from .manager import GeminiContextCache
from .usage import UsageRecord

__all__ = [
    "GeminiChat",
    "GeminiContextCache",
    "GeminiService",
    "TranslationError",
    "UsageRecord",
]
