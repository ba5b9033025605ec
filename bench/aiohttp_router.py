"""``python -m bench.aiohttp_router serve --config FILE``: the router on an aiohttp upstream client.

``proxy_bench``'s ``full-aiohttp`` variant: the router's own command line
(``router.cli.main``, the same arguments as ``python -m router``) with
``router.upstream.UpstreamClient`` replaced by ``bench.aiohttp_upstream``'s client before
any other router module is imported, so whichever module builds the router's client (and
the health checker, semantic cache and Gemini support, which share it) builds this one.
Nothing in ``router/`` changes.

The swap is checked twice: :func:`install` refuses to run once a router module holds the
original class (it would keep building that one), and the client logs
:data:`MARKER` when it starts, which ``proxy_bench`` looks for in the router's log before
it measures.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import router.upstream

from .aiohttp_upstream import AiohttpUpstreamClient

__all__ = ["MARKER", "install", "main"]

MARKER = "upstream client: aiohttp (bench.aiohttp_upstream), not router.http.client"
_ORIGINAL = router.upstream.UpstreamClient


class _AnnouncedClient(AiohttpUpstreamClient):
    async def start(self) -> None:
        await super().start()
        logging.getLogger("bench.aiohttp_router").warning(MARKER)


def install() -> None:
    """Make ``router.upstream.UpstreamClient`` the aiohttp client, for every router module
    imported from now on."""
    holders = [
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("router.")
        and name != "router.upstream"
        and getattr(mod, "UpstreamClient", None) is _ORIGINAL
    ]
    if holders:
        raise RuntimeError(f"imported before the swap, would keep router's client: {holders}")
    router.upstream.UpstreamClient = _AnnouncedClient  # type: ignore[assignment, misc]


def main(argv: Sequence[str] | None = None) -> int:
    install()
    from router.cli import main as router_main

    return router_main(None if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
