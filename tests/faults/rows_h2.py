"""HTTP/2 faults on the push path, and slow consumers closed by their bounded queue.

*HTTP/2 rows* (push mode, ``StackOptions.h2_proxy``): the listener's event-bus dial goes
through ``harness.h2proxy.H2Proxy``, which terminates TLS and sees the frames. It plays
the intermediary a real path has (a load balancer, a service mesh):

* ``push/rst-stream``: ``RST_STREAM`` (``CANCEL``) on every open ``EventBus/Stream``
  call, both ways, the connection and the Session call left up. Each router consumer
  resubscribes on the same session from its last applied event ID;
* ``push/goaway``: ``GOAWAY`` (``NO_ERROR``, last-stream-id the newest stream) on the
  connection, closed 0.2 s later: the listener dials again, says Hello on a new session,
  and each consumer resubscribes from its last applied event ID;
* ``push/router-goaway``: the router's own gRPC server says ``GOAWAY``: a graceful stop
  (SIGTERM) while the listener pushes, then a start on the same port. Requests while it
  is down have nowhere to go (one router); its memory index restarts empty, so the
  listener answers the resubscription with ``resync`` and its snapshot.

Behind each fault the truth changes (sim-1 cleared, sim-2 serving tenants the traffic
never asks for), so only the events sent after the fault can make the index right again.
Expected: lost 0, stale 0; for the first two a resumption (no resync block, ``dup``
measured) and the resubscriptions counted in the notes.

*Overflow rows* (``overflow/pull``, ``overflow/push``): the smallest subscriber queue the
listener allows (16 events), the listener<->router path throttled to a few hundred bytes
a second with small socket buffers, and a burst of about a thousand tenants' events: the
router's stream falls 16 events behind and the listener closes it with
``buffer_overflow`` (the SSE error record; on the bus ``CLOSE_REASON_BUFFER_OVERFLOW``),
which the router counts in ``continuum_kv_event_dropped_total{reason="stream_overflow"}``
and answers by resubscribing from its last applied event ID (while the path stays slow,
again and again). The heal lifts the throttle; the index then converges. A row that saw
no overflow close ends in an error: it did not exercise what it is for.
"""

from __future__ import annotations

from tests.integration.conftest import http

from .procedure import Row, Step
from .rows_net import _change_truth, _heal
from .stack import FaultStack, StackOptions

__all__ = ["H2"]

STREAM_PATH = "/continuum.bus.v1.EventBus/Stream"
SESSION_PATH = "/continuum.bus.v1.EventBus/Session"


async def _nothing(s: FaultStack) -> None:
    return None


async def _rst_streams(s: FaultStack) -> None:
    assert s.h2 is not None
    if s.h2.reset_streams(STREAM_PATH) < len(s.names):
        raise RuntimeError(f"fewer open Stream calls than backends: {s.h2.open_streams}")
    await _change_truth(s)


async def _goaway(s: FaultStack) -> None:
    assert s.h2 is not None
    if s.h2.goaway() < 1:
        raise RuntimeError("no connection to send GOAWAY on")
    await _change_truth(s)


async def _router_graceful_stop(s: FaultStack) -> None:
    assert s.router is not None
    rc = await s.router.stop()
    if rc != 0:
        raise RuntimeError(f"router exited {rc} on SIGTERM")
    await _change_truth(s)


async def _router_start(s: FaultStack) -> None:
    await s.start_router()


async def _bus_counts(s: FaultStack) -> str:
    bus = (await s.kv_stats()).get("event_bus") or {}
    closes = bus.get("stream_closes") or {}
    return (
        f"router event bus: {bus.get('sessions_opened', 0)} session(s) opened, "
        f"{bus.get('subscribes', 0)} subscribe(s), stream closes "
        + (", ".join(f"{k} {v}" for k, v in sorted(closes.items())) or "none")
    )


async def _h2_summary(s: FaultStack) -> str:
    assert s.h2 is not None
    p = s.h2
    if not (p.rst_sent or p.goaways_sent):
        raise RuntimeError("the proxy injected nothing")
    seen = ", ".join(f"{path.rsplit('/', 1)[1]} {n}" for path, n in sorted(p.streams_seen.items()))
    return (
        f"h2 proxy: {p.accepted} connection(s), calls {seen}; {p.rst_sent} RST_STREAM, "
        f"{p.goaways_sent} GOAWAY sent, {p.dropped_frames} frame(s) dropped after a reset; "
        f"{await _bus_counts(s)}; {await s.net_summary()}"
    )


async def _router_goaway_summary(s: FaultStack) -> str:
    return f"{await _bus_counts(s)} (this process); {await s.net_summary()}"


def _h2_row(name: str, fault: str, inject: Step, notes: tuple[str, ...]) -> Row:
    return Row(
        name,
        fault,
        StackOptions(transport="push", h2_proxy=True),
        inject,
        _nothing,
        summary=_h2_summary,
        notes=notes,
    )


OVERFLOW_RATE = 512.0
"""Bytes per second of the overflow rows' path."""
BURST = range(100, 1100)
"""Tenants served straight by sim-2 during the overflow rows' fault: their events."""


async def _throttle_burst(s: FaultStack) -> None:
    await s.throttle_path(OVERFLOW_RATE)
    await _change_truth(s, BURST)


async def _unthrottle(s: FaultStack) -> None:
    await s.throttle_path(None)
    await _heal(s)


async def _stream_overflow_drops(s: FaultStack) -> int:
    """``continuum_kv_event_dropped_total{reason="stream_overflow"}`` summed over the
    backends, from the router's ``/metrics``."""
    assert s.router is not None
    r = await http("GET", s.router.url + "/metrics", total_s=5)
    assert r.status == 200, r
    total = 0.0
    for line in r.body.decode().splitlines():
        if line.startswith("continuum_kv_event_dropped_total{") and (
            'reason="stream_overflow"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def _overflow_summary(s: FaultStack) -> str:
    assert s.listener is not None
    r = await http("GET", s.listener.url + "/stats", total_s=5)
    assert r.status == 200, r
    overflows = sum(int(b["overflows"]) for b in r.json()["hub"]["backends"].values())
    dropped = await _stream_overflow_drops(s)
    if not overflows or not dropped:
        raise RuntimeError(
            f"no overflow close exercised (listener {overflows}, router stream_overflow {dropped})"
        )
    return (
        f"router: continuum_kv_event_dropped_total{{reason=stream_overflow}} {dropped}; "
        f"{await s.net_summary()}"
    )


def _overflow(transport: str) -> Row:
    return Row(
        f"overflow/{transport}",
        f"subscriber queue 16, path throttled to {OVERFLOW_RATE:g} B/s 10 s under a burst of "
        f"{len(BURST)} tenants ({transport}), then unthrottled",
        StackOptions(
            transport=transport,
            net_proxy=True,
            proxy_sock_buf=4096,
            listener_extra={"subscriber_queue_size": 16},
        ),
        _throttle_burst,
        _unthrottle,
        fault_s=10.0,
        summary=_overflow_summary,
        notes=("expected: buffer_overflow closes counted, resubscribed, converges",),
    )


H2: tuple[Row, ...] = (
    _h2_row(
        "push/rst-stream",
        "RST_STREAM (CANCEL) on every EventBus/Stream call by an HTTP/2 proxy; "
        "sim-1 cleared behind it",
        _rst_streams,
        ("expected: each stream resubscribed on the same session from its event ID",),
    ),
    _h2_row(
        "push/goaway",
        "GOAWAY (NO_ERROR, last-stream-id) by an HTTP/2 proxy, connection closed 0.2 s "
        "later; sim-1 cleared behind it",
        _goaway,
        ("expected: a new session, each stream resubscribed from its event ID",),
    ),
    Row(
        "push/router-goaway",
        "router SIGTERM (its gRPC server's GOAWAY) while the listener pushes, start 2 s "
        "later; sim-1 cleared meanwhile",
        StackOptions(transport="push"),
        _router_graceful_stop,
        _router_start,
        unavoidable=True,
        router_restarts=True,
        summary=_router_goaway_summary,
        notes=(
            "one router replica: requests while it is down have nowhere to go",
            "expected: the listener dials again; the empty index is told (resync + snapshot)",
        ),
    ),
    _overflow("pull"),
    _overflow("push"),
)
