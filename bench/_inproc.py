"""One router in the bench's own process (its ``handle``, no HTTP server) in front of
simulated engines, and the closed-loop clients that drive it: what the benches that
time the router's event loop per request share."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from harness.sim.fleet import SimFleet
from router.app import Router
from router.config import load_config
from router.http.types import Request

from .conversation_cost_bench import MODEL, router_yaml

__all__ = ["CLIENTS", "in_process_router", "send"]

CLIENTS = 16
"""Requests in flight: each client sends its next request when its last one answered."""

_HEADERS = {"content-type": "application/json"}


@asynccontextmanager
async def in_process_router(conversation: bool) -> AsyncIterator[Router]:
    """A started router (``conversation_cost_bench.router_yaml``) in front of 3 trivial
    simulated engines."""
    workdir = Path(tempfile.mkdtemp(prefix="router-in-process-"))
    async with SimFleet(n=3, model=MODEL, trivial=True) as fleet:
        cfg = workdir / "router.yaml"
        cfg.write_text(router_yaml(fleet.urls, conversation, 0))
        config, _ = load_config(cfg)
        router = Router(config)
        await router.start()
        try:
            yield router
        finally:
            await router.stop()


async def send(router: Router, bodies: Sequence[bytes], per_client: int, what: str) -> None:
    """``per_client`` chat completions from each of ``CLIENTS`` clients, every client
    walking ``bodies`` from its own offset; a request answered other than 200 raises."""

    async def client(c: int) -> None:
        for j in range(per_client):
            body = bodies[(c * 7 + j) % len(bodies)]
            r = await router.handle(Request("POST", "/v1/chat/completions", "", _HEADERS, body))
            if r.status != 200:
                raise RuntimeError(f"{what}: a request answered {r.status}")

    await asyncio.gather(*(client(c) for c in range(CLIENTS)))
