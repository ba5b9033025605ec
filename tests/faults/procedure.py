"""The rows of the fault matrix, and the one procedure every row follows.

A row: start its own stack, run client traffic, warm until every tenant's key is held
and the index matches the oracle, measure a baseline, inject the fault (a SIGKILL), wait,
heal (start the process again on the same ports), then

* **time to recover**: from the heal until the router's index matches the engines'
  truth with traffic still running (polled); ``(idle)`` when it matched only after the
  traffic stopped, ``never`` when not even then within the bound;
* **lost / stale**: the comparison after traffic stopped and the pipeline settled
  (bounded): the figure the targets (0 and 0) are about;
* **failed**: client requests of the whole row that did not end in a 200, marked
  ``(no other)`` where nothing could have served them (the router itself was down);
* **p99 added**: p99 latency of successful requests from the fault to the recovery
  (or the end of traffic) minus the baseline's p99;
* **dup**: records the router received beyond the numbered events the listener published,
  while both lived; ``-`` where either restarted (counters restart with the process) or a
  resync block was sent (its snapshot restates the state on purpose, its size is not
  reported apart).

Notes under the table give, per row, the router's and the listener's resident memory at
the baseline and at the end (a row of seconds shows growth, it cannot prove a bound), the
truth and index sizes after settling, and the restarted listener's own account (replayed
batches, replay failures, gaps, engine restarts, orphan blocks).

Each row is its own oracle: nothing is compared with a previous run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.conftest import http

from .record import Comparison, Pairs, RowResult, combine, kinds_note, p99, pairs
from .stack import FaultStack, StackOptions
from .traffic import Traffic

__all__ = ["Row", "options_doc", "run_row", "run_rows"]

WARM_S = 60.0
BASELINE_S = 3.0
FAULT_S = 2.0
RECOVER_S = 15.0
SETTLE_S = 15.0
#: Turns of each chat before it starts over, with conversation keys on.
TURNS = 4

Step = Callable[[FaultStack], Awaitable[None]]
Report = Callable[[FaultStack], Awaitable[list[str]]]


@dataclass(frozen=True)
class Row:
    name: str
    fault: str
    opts: StackOptions
    inject: Step
    heal: Step
    #: Requests failing during the fault had nowhere else to go (the router was down).
    unavoidable: bool = False
    #: The router (listener) process restarts: its delivery counters do too, and a
    #: resync's snapshot stands for events never sent one by one: ``dup`` is not measured.
    router_restarts: bool = False
    listener_restarts: bool = False
    notes: tuple[str, ...] = ()
    #: How long the fault lasts before the heal (a partition of 45 s, say).
    fault_s: float = FAULT_S
    #: Minutes, not seconds: run by ``make faults-slow`` (``--slow``), not ``make faults``.
    slow: bool = False
    #: The row's own account, added to its notes at the end (an abuse row: what the
    #: abusers were answered, whether the abused process lived).
    report: Report | None = None
    #: Run once the stack is up, before the traffic (e.g. start router replicas).
    setup: Step | None = None
    #: The client traffic of the row (e.g. spread over several routers); None: the
    #: default :class:`Traffic` through ``stack.router``.
    traffic: Callable[[FaultStack], Traffic] | None = None
    #: A note of the row's own account, taken after settling (what the fault did: the
    #: listener's overflows and resync blocks, a proxy's connections, say).
    summary: Callable[[FaultStack], Awaitable[str]] | None = None
    #: Why (key, backend) pairs first held while the fault lasted cannot reach the index
    #: (no part of the stack still has their events): those pairs are counted apart in
    #: *lost* as expected and the verdict judges the rest; None: every loss is a defect.
    outage_loss: str | None = None


class _Delivery:
    """What the listener published (numbered events, and resync blocks) and the router
    received, from the first sample on; both processes must live through the row."""

    def __init__(self, stack: FaultStack) -> None:
        self.stack = stack
        self._start: tuple[int, int, int] | None = None
        self._now = (0, 0, 0)

    async def _listener_sent(self) -> tuple[int, int]:
        listener = self.stack.listener
        assert listener is not None
        r = await http("GET", listener.url + "/stats", total_s=5)
        assert r.status == 200, r
        hub = r.json()["hub"]["backends"].values()
        return sum(int(b["published"]) for b in hub), sum(int(b["resync_blocks"]) for b in hub)

    async def sample(self) -> None:
        published, blocks = await self._listener_sent()
        self._now = (published, blocks, sum((await self.stack.delivered()).values()))
        if self._start is None:
            self._start = self._now

    @property
    def resync_blocks(self) -> int:
        assert self._start is not None
        return self._now[1] - self._start[1]

    @property
    def duplicates(self) -> int | None:
        """Records received beyond the numbered events published; None when a resync
        block was sent meanwhile (its snapshot restates the state by design, and its size
        is not counted apart)."""
        assert self._start is not None
        if self.resync_blocks:
            return None
        return (self._now[2] - self._start[2]) - (self._now[0] - self._start[0])


async def _compare(
    stack: FaultStack, keys: set[str], excused: Pairs = frozenset()
) -> tuple[Comparison, dict[str, Comparison]]:
    """Every kind of key the stack keys (prefix, and conversation when on): the total, and
    each kind's own; pairs in ``excused`` (an expected loss, ``Row.outage_loss``) are not
    counted as lost."""
    kinds = await stack.compare_kinds(keys)
    if excused:
        kinds = {k: dataclasses.replace(c, lost=c.lost - excused) for k, c in kinds.items()}
    return combine(kinds), kinds


async def _held(stack: FaultStack) -> Pairs:
    """Every (key, backend) pair the engines hold now, of every kind of key."""
    held = pairs(await stack.truth())
    if stack.opts.conversation:
        held |= pairs(await stack.truth_conversation())
    return frozenset(held)


async def _until_clean(
    stack: FaultStack, keys: set[str], within: float, excused: Pairs = frozenset()
) -> tuple[Comparison, bool, dict[str, Comparison]]:
    deadline = time.monotonic() + within
    while True:
        c, kinds = await _compare(stack, keys, excused)
        if c.clean or time.monotonic() >= deadline:
            return c, c.clean, kinds
        await asyncio.sleep(0.2)


async def _recovered(stack: FaultStack, keys: set[str], excused: Pairs = frozenset()) -> bool:
    """The index matches the truth and every event stream is connected again (a router
    that kept its entries through a listener outage has not recovered until it listens)."""
    try:
        if not all(b["connection"]["connected"] for b in await stack.kv_backends()):
            return False
        return (await _compare(stack, keys, excused))[0].clean
    except (TimeoutError, AssertionError, OSError):
        return False


async def _warm(stack: FaultStack, traffic: Traffic) -> None:
    """Until every tenant's key is held somewhere and the index agrees with the truth."""
    deadline = time.monotonic() + WARM_S
    keys = traffic.keys
    while True:
        truth = await stack.truth()
        held = set().union(*truth.values())
        c, _ = await _compare(stack, keys)
        if keys <= held and c.clean:
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"stack never warmed: {len(keys - held)} keys unheld, {c}")
        await asyncio.sleep(0.2)


async def run_row(row: Row, tmp: Path) -> RowResult:
    result = RowResult(row.name, row.fault, notes=list(row.notes))
    stack = FaultStack(row.opts, tmp)
    traffic: Traffic | None = None
    try:
        await stack.start()
        router = stack.router
        assert router is not None
        if row.setup is not None:
            await row.setup(stack)
        traffic = (
            row.traffic(stack)
            if row.traffic is not None
            else Traffic(url=lambda: router.url, turns=TURNS if row.opts.conversation else 0)
        )
        traffic.start()
        await _warm(stack, traffic)
        delivery = _Delivery(stack)
        rss_before = stack.rss_mb()
        await delivery.sample()
        t_base = time.monotonic()
        await asyncio.sleep(BASELINE_S)
        await delivery.sample()
        t_fault = time.monotonic()
        before = await _held(stack) if row.outage_loss else frozenset()
        await row.inject(stack)
        await asyncio.sleep(row.fault_s)
        # Pairs first held during the fault: the ones ``outage_loss`` says cannot come back.
        excused = (await _held(stack)) - before if row.outage_loss else frozenset()
        await row.heal(stack)
        t_heal = time.monotonic()
        if row.router_restarts:
            await stack.wait_connected()
        recovered: float | None = None
        deadline = t_heal + RECOVER_S
        while time.monotonic() < deadline:
            if await _recovered(stack, traffic.keys, excused):
                recovered = time.monotonic() - t_heal
                break
            await asyncio.sleep(0.2)
        t_end_window = time.monotonic()
        await traffic.stop()
        final, clean, by_kind = await _until_clean(stack, traffic.keys, SETTLE_S, excused)
        if recovered is None and clean:
            recovered = time.monotonic() - t_heal
            result.recovered_after_traffic = True
        result.recover_s = recovered
        result.events_lost = final.lost_count
        if row.outage_loss:
            raw, _ = await _compare(stack, traffic.keys)
            result.lost_expected = len(raw.lost & excused)
            result.notes.append(
                f"expected lost: {result.lost_expected} of the {len(excused)} pair(s) first "
                f"held during the fault: {row.outage_loss}"
            )
        result.entries_stale = final.stale_count
        if final.unexplained:
            result.notes.append(f"{final.unexplained} index entries for keys no engine served")
        if not row.router_restarts and not row.listener_restarts:
            await delivery.sample()
            result.duplicates = delivery.duplicates
            if result.duplicates is None:
                result.notes.append(
                    f"{delivery.resync_blocks} resync block(s) sent: their snapshots restate "
                    "the state by design, so dup is not separable"
                )
        failed = [o for o in traffic.outcomes if not o.ok]
        result.requests_failed = len(failed)
        result.requests_total = len(traffic.outcomes)
        result.failed_unavoidable = row.unavoidable
        if failed:
            kinds: dict[str, int] = {}
            for o in failed:
                kinds[o.error or "?"] = kinds.get(o.error or "?", 0) + 1
            result.notes.append(
                "failed: " + ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
            )
        base = [o.latency for o in traffic.window(t_base, t_fault) if o.ok]
        hit = [o.latency for o in traffic.window(t_fault, t_end_window) if o.ok]
        pb, ph = p99(base), p99(hit)
        if pb is not None and ph is not None:
            result.p99_added_ms = (ph - pb) * 1000
        rss_after = stack.rss_mb()
        result.notes.append(
            "RSS MB (baseline -> end): "
            + ", ".join(
                f"{n} {rss_before.get(n, 0):.0f} -> {mb:.0f}" for n, mb in sorted(rss_after.items())
            )
        )
        if row.report is not None:
            result.notes += await row.report(stack)
        result.notes.append(
            f"truth after settling: {final.held} (key, backend) pairs held, {final.indexed} indexed"
            f"; {await stack.listener_summary()}"
        )
        if row.summary is not None:
            result.notes.append(await row.summary(stack))
        if len(by_kind) > 1:
            result.notes.append(kinds_note(by_kind))
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if traffic is not None and traffic._tasks:
            await traffic.stop()
        try:
            await stack.close()
        except Exception as e:  # e.g. a process that did not exit 0 on SIGTERM: a finding
            result.error = result.error or f"teardown: {type(e).__name__}: {e}"
    return result


async def run_rows(rows: list[Row]) -> list[RowResult]:
    results = []
    for row in rows:
        with tempfile.TemporaryDirectory(prefix=f"faults-{row.name.replace('/', '-')}-") as tmp:
            results.append(await run_row(row, Path(tmp)))
    return results


def options_doc() -> dict[str, Any]:
    return {
        "warm_s": WARM_S,
        "baseline_s": BASELINE_S,
        "fault_s": FAULT_S,
        "recover_s": RECOVER_S,
        "settle_s": SETTLE_S,
    }
