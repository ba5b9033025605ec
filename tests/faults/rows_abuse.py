"""Abuse rows: hostile clients on every port of the stack, beside the normal traffic and
KV events (``abuse.py`` holds the abusers). The fault is the abuse itself, for the row's
``fault_s``; the heal stops it. Targets as every row's: lost 0, stale 0, no well-formed
request failed, memory bounded, and the abused process alive at the end (the notes)."""

from __future__ import annotations

from .abuse import (
    BusFlood,
    BusFuzz,
    Campaign,
    HttpFuzz,
    ReloadStorm,
    SlowPosts,
    SseStallers,
    ZmqFuzzProxy,
    listener_sse_stats,
)
from .procedure import Row
from .stack import FaultStack, StackOptions

__all__ = ["ABUSE"]

ABUSE_S = 10.0


def _row(name: str, fault: str, opts: StackOptions, campaign: Campaign, **kw: object) -> Row:
    return Row(
        name,
        fault,
        opts,
        campaign.inject,
        campaign.heal,
        fault_s=kw.pop("fault_s", ABUSE_S),  # type: ignore[arg-type]
        report=campaign.report,
        **kw,  # type: ignore[arg-type]
    )


class _SseCampaign(Campaign):
    async def report(self, stack: FaultStack) -> list[str]:
        return [*await super().report(stack), await listener_sse_stats(stack)]


class _ZmqCampaign(Campaign):
    """The proxy exists before the stack starts (the listener connects to it)."""

    def __init__(self, proxy: ZmqFuzzProxy) -> None:
        super().__init__(lambda: proxy)
        self.proxy = proxy

    async def report(self, stack: FaultStack) -> list[str]:
        lines = await super().report(stack)
        await self.proxy.close()
        return lines


_ZMQ = ZmqFuzzProxy("sim-1", max_frame_bytes=1 << 20)

ABUSE: tuple[Row, ...] = (
    _row(
        "abuse/bus-preauth",
        "event bus: 200 calls with no or a wrong token (some oversize), 100 raw TCP, 10 s",
        StackOptions(transport="push"),
        Campaign(BusFlood),
    ),
    _row(
        "abuse/slow-posts",
        "router: 200 clients trickling POST bodies (a byte per 0.5 s; 408 after 2 s), 10 s",
        StackOptions(router_server={"body_read_timeout_ms": 2000}),
        Campaign(SlowPosts),
    ),
    _row(
        "abuse/slow-posts/cap-full",
        "router: 200 clients trickling POST bodies, max_concurrent_requests 150, 10 s",
        StackOptions(router_server={"body_read_timeout_ms": 2000, "max_concurrent_requests": 150}),
        Campaign(SlowPosts),
        unavoidable=True,
        notes=(
            "the slow bodies hold more slots than the cap: well-formed requests get 503"
            " overloaded (Retry-After) while it is full, by design; failures are expected"
            " here and marked so",
        ),
    ),
    _row(
        "abuse/sse-stall",
        "listener: 300 SSE subscribers that never read (write timeout 1 s), 30 s",
        StackOptions(listener_extra={"subscriber_write_timeout_ms": 1000}),
        _SseCampaign(SseStallers),
        fault_s=30.0,
    ),
    _row(
        "abuse/reload-storm",
        "router config replaced every 50 ms (valid, invalid, non-UTF-8; rename, in place), 20 s",
        StackOptions(),
        Campaign(ReloadStorm),
        fault_s=20.0,
    ),
    _row(
        "abuse/fuzz-http",
        "router: 400 hypothesis HTTP requests (fixed seed), wrong shapes, deep, bad UTF-8",
        StackOptions(),
        Campaign(HttpFuzz),
        fault_s=1.0,
    ),
    _row(
        "abuse/fuzz-bus",
        "event bus: 600 seeded random Session/Stream calls with a valid token",
        StackOptions(transport="push"),
        Campaign(BusFuzz),
        fault_s=1.0,
    ),
    _row(
        "abuse/fuzz-zmq",
        "listener: seeded random ZMQ messages between sim-1's (frames, salts, oversize), 10 s",
        StackOptions(source_endpoint=_ZMQ.endpoint, source_extra={"max_frame_bytes": 1 << 20}),
        _ZmqCampaign(_ZMQ),
    ),
)
