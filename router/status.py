"""The endpoints that report on the router itself: ``/v1/models``, ``/health``, ``/metrics``."""

from __future__ import annotations

import orjson

from .http.types import Request, Response
from .metrics import CONTENT_TYPE, RouterMetrics
from .pool import BackendPool

__all__ = ["StatusApi"]

_JSON_HEADERS = (("content-type", "application/json"),)


class StatusApi:
    def __init__(self, pool: BackendPool, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._metrics = metrics

    async def list_models(self, req: Request) -> Response:
        """The union of the healthy public backends' models (OpenAI's list shape)."""
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": owner}
            for m, owner in self._pool.models()
        ]
        return Response(200, orjson.dumps({"object": "list", "data": data}), [*_JSON_HEADERS])

    async def health(self, req: Request) -> Response:
        """Liveness: answers while the process serves, with healthy/total backend counts."""
        backends = self._pool.backends
        healthy = sum(1 for b in backends if b.healthy and b.config.enabled)
        body = {"status": "ok", "backends": {"healthy": healthy, "total": len(backends)}}
        return Response(200, orjson.dumps(body), [*_JSON_HEADERS])

    async def metrics(self, req: Request) -> Response:
        return Response(200, self._metrics.render(), [("content-type", CONTENT_TYPE)])
