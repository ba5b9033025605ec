"""The shared Redis-fallback supervisor (``router.redis.fallback``), on a real Redis.

``OutageLog`` is the smallest store a supervisor can drive: items go to a Redis list, to
memory while Redis is away, and are replayed into the list on recovery. Tests that kill
Redis use a private server (``redis_server``); the others use the shared one and engage
the fallback by hand. State changes are awaited by polling with a deadline or by events,
never by sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, cast

import pytest
from redis.asyncio import Redis

from router.config.models import RedisConfig
from router.redis import UNAVAILABLE_ERRORS, build_redis
from router.redis.fallback import FallbackSupervisor
from tests import waiting

if TYPE_CHECKING:
    from tests.redis_fixture import RedisServer

pytest_plugins = ("tests.redis_fixture",)

LOGGER = "router.redis.fallback"
SLOW = 3600.0  # a monitor period no test waits for: recovery is driven by hand


async def eventually(predicate: Callable[[], object], within: float = 10.0) -> None:
    await waiting.eventually(predicate, within, 0.01)


class OutageLog:
    """A Redis list with a memory fallback: the store-specific half of a supervisor."""

    def __init__(
        self, client: Redis, key: str, interval_s: float, *, settle_steps: int | None = None
    ) -> None:
        self.client = client
        self.key = key
        self.memory: list[bytes] = []
        self.states: list[bool] = []
        self.pings = 0
        self.replays = 0
        self.replay_gate: asyncio.Event | None = None
        """While set to an unset event, ``replay`` waits for it."""
        self.replay_failures: list[BaseException | bool] = []
        """What the next replays do: raise the exception, or report False (not caught up)."""
        self.memory_at_switch: list[list[bytes]] = []
        self.settle_left = settle_steps or 0
        self.settle_failures: list[BaseException] = []
        self.settled_while_active: list[bool] = []
        self.outages_during_settle: list[BaseException] = []
        """Redis failures the next settle steps run into (after doing their work)."""
        self.supervisor = FallbackSupervisor(
            "test log",
            ping=self.ping,
            replay=self.replay,
            switch_back=self.switch_back,
            unavailable=UNAVAILABLE_ERRORS,
            interval_s=interval_s,
            settle=self.settle if settle_steps is not None else None,
            on_state_change=self.states.append,
        )

    async def append(self, item: bytes) -> None:
        if not self.supervisor.active:
            try:
                await self.client.rpush(self.key, item)
                return
            except UNAVAILABLE_ERRORS as exc:
                self.supervisor.engage("append", exc)
        self.memory.append(item)

    async def in_redis(self) -> list[bytes]:
        # build_redis clients answer bytes (decode_responses=False); redis-py types str too
        return cast("list[bytes]", await self.client.lrange(self.key, 0, -1))

    async def ping(self) -> object:
        self.pings += 1
        return await self.client.ping()

    async def replay(self) -> bool:
        self.replays += 1
        if self.replay_gate is not None:
            await self.replay_gate.wait()
        if self.replay_failures:
            failure = self.replay_failures.pop(0)
            if isinstance(failure, BaseException):
                raise failure
            return failure
        while self.memory:
            await self.client.rpush(self.key, self.memory[0])
            self.memory.pop(0)
        return True

    def switch_back(self) -> str:
        self.memory_at_switch.append(list(self.memory))
        return "outage items replayed"

    async def settle(self) -> bool:
        self.settled_while_active.append(self.supervisor.active)
        if self.settle_failures:
            raise self.settle_failures.pop(0)
        if not self.settle_left:
            return False
        self.settle_left -= 1
        if self.outages_during_settle:
            self.supervisor.engage("settle", self.outages_during_settle.pop(0))
        return True


def other_tasks(before: set[asyncio.Task[object]]) -> set[asyncio.Task[object]]:
    return asyncio.all_tasks() - before


def key() -> str:
    return f"test:redis-fallback:{uuid.uuid4().hex}"


MakeLog = Callable[..., OutageLog]


@pytest.fixture
async def make_log(redis_url: str) -> AsyncIterator[MakeLog]:
    """``make_log(interval_s, settle_steps=None, url=None)``: an ``OutageLog`` on the shared
    Redis (or ``url``), its supervisor closed and its key deleted afterwards."""
    clients: dict[str, Redis] = {}
    made: list[OutageLog] = []

    def make(
        interval_s: float, *, settle_steps: int | None = None, url: str | None = None
    ) -> OutageLog:
        url = url or redis_url
        if url not in clients:
            clients[url] = build_redis(RedisConfig(url=url, connect_timeout_ms=200))
        log = OutageLog(clients[url], key(), interval_s, settle_steps=settle_steps)
        made.append(log)
        return log

    try:
        yield make
    finally:
        for log in made:
            await log.supervisor.close()
            with contextlib.suppress(*UNAVAILABLE_ERRORS):
                await log.client.delete(log.key)
        for client in clients.values():
            await client.aclose(close_connection_pool=True)


async def test_engages_once_per_outage_and_calls_the_hook_on_each_switch(
    redis_server: RedisServer, make_log: MakeLog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = make_log(SLOW, url=redis_server.url)
    sup = log.supervisor
    await log.append(b"0")
    assert (sup.active, sup.count, log.states) == (False, 0, [])
    await sup.wait_recovered()  # returns at once: Redis never stopped

    redis_server.kill()
    await asyncio.gather(*(log.append(b"%d" % i) for i in range(1, 6)))
    outage = [b"1", b"2", b"3", b"4", b"5"]
    assert sup.active and sup.count == 1 and log.states == [True]
    engaged = [r for r in caplog.records if "unavailable during append" in r.getMessage()]
    assert len(engaged) == 1  # one burst of failures, one warning
    assert "checking Redis every 3600s" in engaged[0].getMessage()
    sup.engage("append", ConnectionError("again"))  # same outage: nothing
    assert sup.count == 1 and log.states == [True]
    assert sorted(log.memory) == outage
    waiter = asyncio.create_task(sup.wait_recovered())
    assert await sup.try_recover() is False  # still down
    assert sup.active and not waiter.done()

    await asyncio.to_thread(redis_server.start)  # same port, empty
    assert await sup.try_recover() is True
    await asyncio.wait_for(waiter, 10)
    assert not sup.active and log.states == [True, False]
    assert log.memory_at_switch == [[]]  # everything was in Redis before the switch
    assert sorted(await log.in_redis()) == outage
    assert any("test log available again" in r.getMessage() for r in caplog.records)
    assert await sup.try_recover() is True  # nothing to recover: no attempt made
    assert log.replays == 1

    redis_server.kill()
    await log.append(b"6")  # a new outage counts and notifies again
    assert sup.active and sup.count == 2 and log.states == [True, False, True]
    await asyncio.to_thread(redis_server.start)
    assert await sup.try_recover() is True
    assert log.states == [True, False, True, False]


async def test_monitor_recovers_when_redis_returns_then_stops(
    redis_server: RedisServer, make_log: MakeLog
) -> None:
    log = make_log(0.02, url=redis_server.url)
    sup = log.supervisor
    before = asyncio.all_tasks()
    redis_server.kill()
    await log.append(b"during")
    assert sup.active
    assert other_tasks(before)  # the monitor
    await eventually(lambda: log.pings >= 3)  # keeps trying while Redis is down
    assert sup.active and log.replays == 0

    await asyncio.to_thread(redis_server.start)
    await asyncio.wait_for(sup.wait_recovered(), 10)
    assert not sup.active and log.states == [True, False]
    assert await log.in_redis() == [b"during"]
    await eventually(lambda: not other_tasks(before))  # nothing left to do: it ends
    pings = log.pings
    await log.append(b"after")  # back on Redis: no more PINGs
    assert log.pings == pings and await log.in_redis() == [b"during", b"after"]


async def test_a_failing_recovery_attempt_leaves_the_fallback_engaged(make_log: MakeLog) -> None:
    log = make_log(SLOW)
    sup = log.supervisor
    sup.engage("append", ConnectionError("test"))
    await log.append(b"x")
    log.replay_failures = [RuntimeError("replay bug"), False]
    with pytest.raises(RuntimeError, match="replay bug"):
        await sup.try_recover()  # not an outage error: the caller sees it
    assert sup.active and log.states == [True]
    assert await sup.try_recover() is False  # could not catch up: later
    assert sup.active and log.memory_at_switch == []
    assert await sup.try_recover() is True
    assert await log.in_redis() == [b"x"] and log.states == [True, False]


async def test_the_monitor_retries_a_failing_recovery(
    make_log: MakeLog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = make_log(0.02)
    sup = log.supervisor
    log.replay_failures = [RuntimeError("replay bug"), False, RuntimeError("replay bug")]
    sup.engage("append", ConnectionError("test"))
    await log.append(b"x")
    await asyncio.wait_for(sup.wait_recovered(), 10)
    assert log.replays == 4 and log.states == [True, False]
    assert await log.in_redis() == [b"x"]
    failed = [r for r in caplog.records if "recovery failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info for r in failed)


async def test_concurrent_recovery_attempts_never_overlap(make_log: MakeLog) -> None:
    log = make_log(SLOW)
    sup = log.supervisor
    sup.engage("append", ConnectionError("test"))
    await log.append(b"x")
    log.replay_gate = asyncio.Event()
    attempts = [asyncio.create_task(sup.try_recover()) for _ in range(3)]
    await eventually(lambda: log.replays >= 1)  # one attempt holds the lock, waiting
    log.replay_gate.set()
    assert await asyncio.gather(*attempts) == [True, True, True]
    assert log.replays == 1 and log.states == [True, False]  # one replay, one switch
    assert await log.in_redis() == [b"x"]  # replayed once


async def test_a_cancelled_recovery_attempt_propagates_and_changes_nothing(
    make_log: MakeLog,
) -> None:
    log = make_log(SLOW)
    sup = log.supervisor
    sup.engage("append", ConnectionError("test"))
    await log.append(b"x")
    log.replay_gate = asyncio.Event()
    attempt = asyncio.create_task(sup.try_recover())
    await eventually(lambda: log.replays == 1)
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    assert sup.active and log.states == [True] and log.memory == [b"x"]
    log.replay_gate.set()
    assert await asyncio.wait_for(sup.try_recover(), 10) is True  # the lock was released
    assert await log.in_redis() == [b"x"]


async def test_close_stops_the_monitor_and_keeps_the_state(make_log: MakeLog) -> None:
    log = make_log(0.02)
    sup = log.supervisor
    before = asyncio.all_tasks()
    log.replay_gate = asyncio.Event()  # the monitor's attempt hangs in the replay
    sup.engage("append", ConnectionError("test"))
    await eventually(lambda: log.replays == 1)
    await sup.close()
    assert not other_tasks(before)
    assert sup.active and log.states == [True]
    await sup.close()  # idempotent
    log.replay_gate.set()
    assert await sup.try_recover() is True  # still usable by hand


async def test_close_propagates_its_own_cancellation(make_log: MakeLog) -> None:
    log = make_log(0.02)
    sup = log.supervisor
    log.replay_gate = asyncio.Event()
    sup.engage("append", ConnectionError("test"))
    await eventually(lambda: log.replays == 1)
    closer = asyncio.create_task(sup.close())
    await asyncio.sleep(0)  # the closer has cancelled the monitor and waits for it
    closer.cancel()  # a shutdown that is itself cancelled stays cancelled
    with pytest.raises(asyncio.CancelledError):
        await closer


async def test_settle_runs_after_the_switch_back_until_done(
    make_log: MakeLog, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    log = make_log(0.02, settle_steps=3)
    log.settle_failures = [RuntimeError("settle bug")]
    sup = log.supervisor
    before = asyncio.all_tasks()
    sup.engage("append", ConnectionError("test"))
    await asyncio.wait_for(sup.wait_recovered(), 10)
    await eventually(lambda: not other_tasks(before))
    assert log.settle_left == 0
    # One failed step (retried), three done, one that found nothing left: all on Redis.
    assert log.settled_while_active == [False] * 5
    assert any("applying outage changes failed" in r.getMessage() for r in caplog.records)


async def test_an_outage_during_settle_goes_back_to_recovering(make_log: MakeLog) -> None:
    log = make_log(0.02, settle_steps=1)
    log.outages_during_settle = [ConnectionError("second outage")]
    sup = log.supervisor
    before = asyncio.all_tasks()
    sup.engage("append", ConnectionError("first outage"))
    await eventually(lambda: log.states == [True, False, True, False])
    await eventually(lambda: not other_tasks(before))
    assert sup.count == 2 and not sup.active
    assert log.replays == 2  # the second outage was recovered from like the first


async def test_start_monitor_sets_the_period_and_intervals_are_validated(
    make_log: MakeLog,
) -> None:
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="monitor_interval_s"):
            make_log(bad)
    log = make_log(SLOW)
    sup = log.supervisor
    with pytest.raises(ValueError, match="monitor_interval_s"):
        sup.start_monitor(0)
    assert sup.interval_s == SLOW
    sup.start_monitor(0.02)  # at startup: nothing to watch yet, the period is kept
    assert sup.interval_s == 0.02 and not sup.active
    sup.engage("append", ConnectionError("test"))
    await asyncio.wait_for(sup.wait_recovered(), 10)  # not an hour
    assert log.states == [True, False]
