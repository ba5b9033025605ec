"""Rows with several routers on one Redis index: replicas behind a load balancer.

Every router of these rows pulls every source itself and writes the one Redis index (and
cache); the oracle is read through ``stack.router``, which sees what every replica wrote.
Client traffic goes through :class:`BalancedTraffic`: round robin over the routers that
run, and a request refused by one (connection refused or reset, ``503 shutting_down``)
is sent to the next, as a load balancer with retries does; it fails only when no router
could answer it.

* ``multi/rolling-restart``: three routers, each SIGTERMed and started again in turn
  (waiting for its consumers before the next, as a rolling deploy does).
* ``multi/clock-step``: one of two routers runs under libfaketime (Debian's
  ``faketime`` package: ``LD_PRELOAD`` with ``FAKETIME_TIMESTAMP_FILE``, wall clock only,
  ``FAKETIME_DONT_FAKE_MONOTONIC=1``); the row rewrites its clock file to step its wall
  clock two hours forward (past the 600 s entry TTL) while it sweeps every 500 ms: the
  other router's entries must not be deleted.
* ``multi/resync-kill``: a second router starts (its consumers begin with ``resync`` +
  snapshot, which it writes under a new generation of each backend and swaps in after
  the snapshot's last record) and is SIGSTOPped the moment its first resync takes a
  generation; the row compares what the first router serves with the engines' truth
  while that resync stands half done, then SIGKILLs it. What the kill leaves in the index
  is what every other router serves from; it stays down (the first router serves).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import aiohttp

from harness.procs import ChildExited
from tests.integration.conftest import http, wait_until

from .procedure import TURNS, Row
from .stack import FaultStack, StackOptions
from .traffic import Outcome, Traffic

__all__ = ["MULTI", "BalancedTraffic"]


@dataclass
class BalancedTraffic(Traffic):
    """Traffic over every running router (``urls()``), retried on the next one when a
    router cannot take the request; one outcome per client request."""

    urls: Callable[[], list[str]] = field(default=list)
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    async def _request(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> Outcome:
        t0 = time.monotonic()
        urls = self.urls()
        first = next(self._turn)
        outcome = Outcome(t0, 0.0, False, None, "no router")
        for k in range(len(urls)):
            outcome = await self._post(session, urls[(first + k) % len(urls)], body, t0)
            if outcome.ok or not _retryable(outcome):
                break
        return outcome


def _retryable(o: Outcome) -> bool:
    """Refused by that router (connection refused or reset, 503: shutting down or
    overloaded): a load balancer sends it to the next. A timeout is not retried."""
    if o.error is None or o.error == "TimeoutError":
        return False
    return o.error == "HTTP 503" or not o.error.startswith("HTTP ")


def balanced(stack: FaultStack) -> Traffic:
    router = stack.router
    assert router is not None
    return BalancedTraffic(
        url=lambda: router.url,
        urls=lambda: [r.url for r in stack.routers if r.running],
        turns=TURNS if stack.opts.conversation else 0,
    )


async def _start_replicas(s: FaultStack) -> None:
    await s.start_replicas()


async def _nothing(s: FaultStack) -> None:
    return None


# -- multi/rolling-restart ----------------------------------------------------------------


async def _rolling_restart(s: FaultStack) -> None:
    """Each router in turn: SIGTERM, exit 0, start on the same ports, consumers up."""
    for rp in list(reversed(s.routers)):
        rc = await s.restart(rp)
        if rc != 0:
            raise AssertionError(f"{rp.config_path.name} exited {rc} on SIGTERM")


# -- multi/clock-step ---------------------------------------------------------------------


async def _step_clock(s: FaultStack) -> None:
    """Step the replica's wall clock +2 h, and see it stepped: the ``Date`` header of its
    answers (its HTTP server's wall clock) is 2 h ahead of ours."""
    rp = s.replicas[0]
    s.step_clock(rp, "+2h")

    async def stepped() -> bool:
        r = await http("GET", rp.url + "/health", total_s=2)
        date = {k.lower(): v for k, v in r.headers.items()}.get("date")
        ahead = datetime.now(UTC) + timedelta(hours=1)
        return date is not None and parsedate_to_datetime(date) > ahead

    await wait_until(stepped, within=10, interval=0.1, what="the replica's clock stepped")


# -- multi/resync-kill --------------------------------------------------------------------

#: What the last ``multi/resync-kill`` caught: the row's own account, in its notes.
_RESYNC_SEEN: list[str] = []


def _pid_running(config: Path) -> int | None:
    """The pid of the process started with ``--config <config>`` (a router this row
    launched and that has not printed READY yet, so its Service has no handle)."""
    needle = str(config).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in argv and b"router" in argv:
            return int(entry.name)
    return None


async def _kill_while_resyncing(s: FaultStack) -> None:
    """Start a second router, SIGSTOP it the moment its first resync takes a generation
    (``#seq`` moves), compare what the first router serves with the engines' truth while
    the resync stands half done, then SIGKILL it."""
    from redis.asyncio import Redis

    assert s.redis is not None and s.router is not None
    _RESYNC_SEEN.clear()
    client = Redis.from_url(s.redis.url)
    kp = "cr:kvidx:"
    try:
        seq0 = int(await client.get(kp + "#seq") or 0)
        config = copy.deepcopy(s.router.config)
        config["server"] = {
            **config["server"],
            "listen": "127.0.0.1:0",
            "grpc_listen": "127.0.0.1:0",
        }
        path = s.next_router_path()
        start = asyncio.ensure_future(s.launch_router(config))
        deadline = time.monotonic() + 30
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = _pid_running(path)
            await asyncio.sleep(0.01)
        took = False
        while pid is not None and time.monotonic() < deadline:
            if int(await client.get(kp + "#seq") or 0) > seq0:
                os.kill(pid, signal.SIGSTOP)
                took = True
                break
        if pid is None or not took:
            start.cancel()
            raise AssertionError("the second router took no generation within 30 s")
        raw = await client.hgetall(kp + "#gens")
        gens = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        swapped = sorted(b for b, g in gens.items() if g > seq0)
        _RESYNC_SEEN.append(
            f"stopped after its resync took generation {seq0 + 1}: "
            f"{len(swapped)} of {len(s.names)} backends swapped in by then"
            + (f" ({', '.join(swapped)})" if swapped else "")
        )
        mid = await s.compare(set())
        _RESYNC_SEEN.append(
            f"the first router's index while that resync stood half done: lost "
            f"{mid.lost_count}, stale {mid.stale_count} (of {mid.held} pairs held)"
        )
        os.kill(pid, signal.SIGKILL)
    finally:
        await client.aclose()
    with contextlib.suppress(ChildExited):
        rp = await start
        await rp.kill()
        s.forget_router(rp)


async def _resync_report(s: FaultStack) -> list[str]:
    return list(_RESYNC_SEEN)


MULTI: tuple[Row, ...] = (
    Row(
        "multi/rolling-restart",
        "3 routers on one Redis index, each SIGTERMed and restarted in turn (pull)",
        StackOptions(index="redis", replicas=2),
        _rolling_restart,
        _nothing,
        router_restarts=True,
        setup=_start_replicas,
        traffic=balanced,
        fault_s=0.5,
        notes=(
            "traffic round-robin over the running routers, a refused request retried on "
            "the next (a load balancer with retries): failed counts requests no router took",
        ),
    ),
    Row(
        "multi/clock-step",
        "1 of 2 routers' wall clock stepped +2h (past the 600 s TTL), sweeping every 0.5 s",
        StackOptions(index="redis", replicas=1, faketime=True, replica_sweep_ms=500),
        _step_clock,
        _nothing,
        setup=_start_replicas,
        traffic=balanced,
        fault_s=5.0,
        notes=(
            "libfaketime (Debian faketime) LD_PRELOADed into the second router, wall clock "
            "only (FAKETIME_DONT_FAKE_MONOTONIC=1), its timestamp file rewritten at runtime",
        ),
    ),
    Row(
        "multi/resync-kill",
        "a 2nd router SIGKILLed while it resyncs both backends on the shared Redis index",
        StackOptions(index="redis"),
        _kill_while_resyncing,
        _nothing,
        fault_s=1.0,
        report=_resync_report,
        notes=("the killed router stays down; the first one serves",),
    ),
)
