"""Network faults on the listener<->router event path: a loopback ``BlackholeProxy``
(``harness.netproxy``) sits between them (``StackOptions.net_proxy``). In pull mode the
router's SSE GETs go through it; in push mode the listener's TLS/HTTP2 dial to the
router's event bus does.

A *partition* blackholes the path (no bytes either way, no FIN, no RST: a dead path or a
crashed NAT) for ``fault_s``, then heals it: held connections dial upstream and held
bytes flow, as TCP retransmission would deliver them. What bounds the recovery:

* a partition shorter than the dead-stream detection (pull: the router's
  ``read_timeout_ms``, 60 s by default, four of the listener's 15 s heartbeats; push:
  HTTP/2 keepalive, a ping after 20 s idle and 10 s for its ack, both sides) leaves the
  connections up: the heal delivers what was held, nothing is replayed;
* a longer one is detected, the stream dropped, and reconnects are attempted through the
  dead path, each one ending in its own timeout (pull: ``read_timeout_ms``; push: the
  listener's ``connect_timeout``) and backing off; after the heal the one in flight, or
  the next, resumes by event ID (or ``resync`` when the ring no longer covers the gap).

Behind every fault the truth changes in a way the client traffic cannot hide: sim-2
serves tenants the traffic never asks for (straight, bypassing the router), so only their
events can put them in the index, and sim-1 drops its cache.

Other rows: a *NAT restart* (the path's connections silent for good, new ones through:
only the dead-stream bounds end them), *resets* (RST mid-stream and for 2 s), *slow
consumers* (the path throttled to a few KB/s with small socket buffers, so the
listener's per-subscriber queue overflows: resumption from its history ring when the
ring covers the gap, ``resync`` + snapshot when it does not), and an *engine restart
behind a partition* of its ZMQ path (the listener hears of the sequence reset only at
the heal).
"""

from __future__ import annotations

import asyncio

from .procedure import Row
from .stack import FaultStack, StackOptions

__all__ = ["NET"]


DIRECT = range(100, 104)
"""Tenants served straight by an engine during a fault: keys the client traffic never
asks for, so nothing but their events can put them in the index (and nothing hides a
loss of them: the traffic refills sim-1's cleared keys by itself)."""


async def _change_truth(s: FaultStack, tenants: range = DIRECT) -> None:
    """sim-1 drops its cache (``AllBlocksCleared``) and sim-2 serves ``tenants``."""
    await asyncio.sleep(0.5)
    await s.clear_engine(0)
    await s.serve_direct(1, tenants)


async def _blackhole(s: FaultStack) -> None:
    """Partition the path, then change the truth behind it: the router's index is wrong
    until the events queued behind the partition arrive."""
    await s.blackhole()
    await _change_truth(s)


async def _heal(s: FaultStack) -> None:
    await s.heal_path()


def _partition(transport: str, seconds: float, label: str, *, slow: bool = False) -> Row:
    mode = "pull, SSE" if transport == "pull" else "push, event bus"
    return Row(
        f"net-partition/{transport}-{label}",
        f"listener<->router path blackholed {label} ({mode}), sim-1 cleared behind it",
        StackOptions(transport=transport, net_proxy=True),
        _blackhole,
        _heal,
        fault_s=seconds,
        slow=slow,
        summary=FaultStack.net_summary,
    )


async def _strand(s: FaultStack) -> None:
    """A NAT restarts after ``fault_s`` of blackhole: the connections open through it stay
    silent for good, new ones get through; sim-1 was cleared during the blackhole."""
    await s.strand_path()


#: Dead-stream bounds of the NAT rows, short so that the row shows the bound at work
#: (the defaults, 60 s of read timeout and 20 s + 10 s of keepalive, bound it the same way,
#: only later than this procedure waits).
_PULL_BOUND = StackOptions(
    net_proxy=True,
    listener_extra={"heartbeat_interval_ms": 1000},
    event_source_extra=(("read_timeout_ms", 3000),),
)
_PUSH_BOUND = StackOptions(
    transport="push",
    net_proxy=True,
    listener_bus_extra=(("keepalive_time", "2s"), ("keepalive_timeout", "2s")),
    router_bus_extra=(
        ("keepalive_time_ms", 2000),
        ("keepalive_timeout_ms", 2000),
        ("min_client_ping_interval_ms", 1000),
    ),
)


SLOW_RATE = 1024.0
"""Bytes per second of a slow path: far below what the traffic's events take."""


async def _throttle(s: FaultStack) -> None:
    """The router's reading falls behind (the path carries 1 KB/s) while hundreds of
    events are published: the backlog waits in the buffers on the way (the listener's
    write buffer flushes per 64 KB, the sockets'), behind the router's position."""
    await s.throttle_path(SLOW_RATE)
    await _change_truth(s, range(100, 400))


async def _drop_behind(s: FaultStack) -> None:
    """The slow connection is reset with its backlog in flight (lost with it), and the
    path is whole again: the router asks from its last applied event ID, hundreds of
    events behind the listener."""
    await s.reset_path()
    await s.throttle_path(None)
    await s.heal_path()


def _slow(transport: str, ring: int | None) -> Row:
    covered = ring is None
    extra: dict[str, object] = {"subscriber_queue_size": 16}
    if ring is not None:
        extra["history_size"] = ring
    return Row(
        f"net-slow/{transport}-{'ring-covers' if covered else 'ring-exceeded'}",
        f"path throttled to {SLOW_RATE / 1024:g} KB/s 10 s, then reset with its backlog "
        f"({transport}; "
        + ("ring 10000: covers the gap)" if covered else f"ring {ring}: the gap exceeds it)"),
        StackOptions(
            transport=transport, net_proxy=True, listener_extra=extra, proxy_sock_buf=4096
        ),
        _throttle,
        _drop_behind,
        fault_s=10.0,
        summary=FaultStack.net_summary,
        notes=(
            ("expected: resumes by event ID, no resync block",)
            if covered
            else ("expected: told (resync + snapshot) and converges",)
        ),
    )


async def _engine_restart_behind_partition(s: FaultStack) -> None:
    """sim-1's ZMQ path to the listener goes dead; behind it sim-1 is SIGKILLed and
    started again empty (sequence from 0): the listener hears of it only at the heal."""
    await s.blackhole_engine_path()
    await asyncio.sleep(0.5)
    await s.kill_engine(0)
    await asyncio.sleep(1.0)
    await s.start_engine(0)
    await s.serve_direct(0, DIRECT)


async def _heal_engine_path(s: FaultStack) -> None:
    await s.heal_engine_path()


async def _reset(s: FaultStack) -> None:
    """Every connection of the path is reset (RST) mid-stream, and each new one for
    ``fault_s``; sim-1 is cleared meanwhile."""
    await s.reset_path()
    await _change_truth(s)


def _resets(transport: str) -> Row:
    what = "SSE GETs" if transport == "pull" else "the event bus's HTTP/2 connection"
    return Row(
        f"net-reset/{transport}",
        f"path RST mid-stream, and every new connection for 2 s ({transport}: {what})",
        StackOptions(transport=transport, net_proxy=True),
        _reset,
        _heal,
        summary=FaultStack.net_summary,
        notes=("expected: resumes from the last applied event ID, no resync block",),
    )


NET: tuple[Row, ...] = (
    _partition("pull", 5.0, "5s"),
    _partition("pull", 45.0, "45s"),
    _partition("push", 5.0, "5s"),
    _partition("push", 45.0, "45s"),
    Row(
        "net-nat-restart/pull",
        "path blackholed 5 s, then its connections silent for good (NAT restart); pull, "
        "heartbeat 1 s, read_timeout_ms 3000",
        _PULL_BOUND,
        _blackhole,
        _strand,
        fault_s=5.0,
        summary=FaultStack.net_summary,
    ),
    Row(
        "net-nat-restart/push",
        "path blackholed 5 s, then its connections silent for good (NAT restart); push, "
        "keepalive 2 s + 2 s both ends",
        _PUSH_BOUND,
        _blackhole,
        _strand,
        fault_s=5.0,
        summary=FaultStack.net_summary,
    ),
    _slow("pull", None),
    _slow("pull", 16),
    _slow("push", None),
    _slow("push", 16),
    Row(
        "net-engine-partition/restart",
        "sim-1<->listener ZMQ path blackholed 5 s; behind it sim-1 SIGKILL, restart empty",
        StackOptions(engine_proxy=True),
        _engine_restart_behind_partition,
        _heal_engine_path,
        fault_s=5.0,
        summary=FaultStack.net_summary,
        notes=("expected: the listener notices the sequence reset at the heal and resyncs",),
    ),
    _resets("pull"),
    _resets("push"),
    _partition("pull", 300.0, "5min", slow=True),
    _partition("push", 300.0, "5min", slow=True),
)
