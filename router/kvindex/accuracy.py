"""Predicted against delivered: the live check of KV-aware routing.

For every request the router routes on the index it knows how many prompt tokens it
expects the chosen backend to reuse (the held tokens it scored); vLLM and SGLang report
how many they did reuse (``usage.prompt_tokens_details.cached_tokens``). The forwarder
hands both over::

    accuracy.record(backend, predicted_cached_tokens, reported_cached_tokens)

for non-streamed bodies and for the usage chunk of a stream (when the client asked for
usage; ``router.gemini.usage.cached_tokens_of`` reads it). Per backend this keeps the sums
and the absolute error, for ``/admin/kv-index/stats``; ``on_record`` feeds Prometheus
(``RouterMetrics.kv_prediction``: both sums as counters and the error histogram).

``accuracy = 1 - sum(|reported - predicted|) / sum(max(reported, predicted))``: 1 when every
prediction was exact, 0 when none overlapped. Expect ``reported`` a little above
``predicted``: engines reuse whole blocks (16 tokens) while the index knows whole chunks
(``chunk_bytes`` of prompt, some 250 tokens); what the histogram should not show is a wide
spread of negative errors (tokens predicted that were not there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["BackendAccuracy", "PredictionAccuracy"]

_MAX_BACKENDS = 4096


@dataclass(slots=True)
class BackendAccuracy:
    """One backend's sums since start."""

    requests: int = 0
    predicted_tokens: int = 0
    reported_tokens: int = 0
    abs_error_tokens: int = 0
    scale_tokens: int = 0
    """Sum of max(reported, predicted): the accuracy's denominator."""

    @property
    def accuracy(self) -> float:
        if not self.scale_tokens:
            return 1.0
        return 1.0 - self.abs_error_tokens / self.scale_tokens

    def document(self) -> dict[str, Any]:
        """The admin JSON of this backend (rates as 4-decimal strings, as elsewhere)."""
        n = self.requests
        return {
            "requests": n,
            "predicted_cached_tokens": self.predicted_tokens,
            "reported_cached_tokens": self.reported_tokens,
            "mean_abs_error_tokens": f"{(self.abs_error_tokens / n) if n else 0.0:.1f}",
            "accuracy": f"{self.accuracy:.4f}",
        }


class PredictionAccuracy:
    """Per-backend sums of predicted and reported cached tokens (module docstring)."""

    def __init__(self, on_record: Callable[[str, int, int], None] | None = None) -> None:
        """
        Args:
            on_record: ``(backend, predicted, reported)`` of every record (metrics).
        """
        self._backends: dict[str, BackendAccuracy] = {}
        self._on_record = on_record

    def record(
        self, backend: str, predicted_cached_tokens: int, reported_cached_tokens: int
    ) -> None:
        """One answered request: what the router expected ``backend`` to reuse and what it
        says it reused. Negative values count as 0."""
        p = max(0, int(predicted_cached_tokens))
        r = max(0, int(reported_cached_tokens))
        acc = self._backends.get(backend)
        if acc is None:
            if len(self._backends) >= _MAX_BACKENDS:
                return
            acc = self._backends[backend] = BackendAccuracy()
        acc.requests += 1
        acc.predicted_tokens += p
        acc.reported_tokens += r
        acc.abs_error_tokens += abs(r - p)
        acc.scale_tokens += max(r, p)
        if self._on_record is not None:
            self._on_record(backend, p, r)

    def get(self, backend: str) -> BackendAccuracy | None:
        return self._backends.get(backend)

    def total(self) -> BackendAccuracy:
        """The sums over every backend."""
        t = BackendAccuracy()
        for acc in self._backends.values():
            t.requests += acc.requests
            t.predicted_tokens += acc.predicted_tokens
            t.reported_tokens += acc.reported_tokens
            t.abs_error_tokens += acc.abs_error_tokens
            t.scale_tokens += acc.scale_tokens
        return t

    def document(self) -> dict[str, dict[str, Any]]:
        """Every backend with records, by name (``/admin/kv-index/stats``)."""
        return {name: acc.document() for name, acc in sorted(self._backends.items())}
