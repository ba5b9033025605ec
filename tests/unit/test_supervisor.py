"""bus.supervisor: verdicts, failure counting and reset, stop, cancellation; never a real wait.

Every test injects ``sleep`` (recording the delays, or blocking on an event it controls),
so nothing here waits on a timer. The last tests drive the supervisor the way the router's
event consumer and the listener's push client use it, to show both loops fit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from bus.backoff import NoBackoff
from bus.supervisor import Attempt, Supervisor, Verdict

TIMEOUT = 5.0


class LinearBackoff(NoBackoff):
    """``failures`` seconds, so each recorded delay says which step it was."""

    def compute(self, failures: int) -> float:
        super().compute(failures)
        return float(failures)


class Sleeps:
    """An injected sleep that records delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class Script:
    """``run_once`` playing one step per connection, then stopping the supervisor.

    A step is an exception (raised), ``None`` (a clean end), or a callable run with the
    supervisor first (to report health) whose result is the step.
    """

    def __init__(self, *steps: object) -> None:
        self.steps = list(steps)
        self.calls = 0
        self.sup: Supervisor | None = None

    def done(self) -> bool:
        return self.calls >= len(self.steps)

    async def __call__(self) -> None:
        step = self.steps[self.calls]
        self.calls += 1
        while callable(step) and not isinstance(step, BaseException):
            assert self.sup is not None
            step = step(self.sup)
        if isinstance(step, BaseException):
            raise step


def healthy_then(step: object) -> Callable[[Supervisor], object]:
    def run(sup: Supervisor) -> object:
        sup.healthy()
        sup.healthy()  # a second report of the same connection changes nothing
        return step

    return run


def retry_all(error: Exception | None) -> Verdict:
    return Verdict.RETRY


def supervise(
    script: Script,
    classify: Callable[[Exception | None], Verdict] = retry_all,
    **kw: object,
) -> tuple[Supervisor, LinearBackoff, Sleeps, list[Attempt]]:
    backoff, sleeps = LinearBackoff(), Sleeps()
    attempts: list[Attempt] = []
    kw.setdefault("should_stop", script.done)
    kw.setdefault("on_retry", attempts.append)
    sup = Supervisor(script, classify, backoff=backoff, sleep=sleeps, **kw)  # type: ignore[arg-type]
    script.sup = sup
    return sup, backoff, sleeps, attempts


# -- verdicts and counting ---------------------------------------------------------------------


async def test_consecutive_failures_double_through_the_backoff() -> None:
    script = Script(OSError("a"), OSError("b"), OSError("c"), None)
    sup, backoff, sleeps, attempts = supervise(script)
    await sup.run()
    assert script.calls == 4
    assert backoff.computed == [1, 2, 3]  # the clean end is the last step: stopped after it
    assert sleeps.delays == [1.0, 2.0, 3.0]
    assert [(a.number, str(a.error), a.failures, a.delay) for a in attempts] == [
        (1, "a", 1, 1.0),
        (2, "b", 2, 2.0),
        (3, "c", 3, 3.0),
    ]
    assert backoff.resets == 0 and sup.attempts == 4


async def test_a_clean_end_is_classified_as_none_and_counts_when_retried() -> None:
    seen: list[Exception | None] = []

    def classify(error: Exception | None) -> Verdict:
        seen.append(error)
        return Verdict.RETRY

    script = Script(None, None, OSError("x"))
    sup, backoff, _sleeps, attempts = supervise(script, classify)
    await sup.run()
    assert seen[:2] == [None, None] and isinstance(seen[2], OSError)
    assert backoff.computed == [1, 2]
    assert [a.error for a in attempts] == [None, None]


async def test_a_healthy_connection_resets_the_count_and_the_backoff_once() -> None:
    script = Script(
        OSError("1"),
        OSError("2"),
        healthy_then(OSError("3")),  # proved itself, then failed: failure 1 again
        OSError("4"),
        None,
    )
    sup, backoff, _sleeps, attempts = supervise(script)
    await sup.run()
    assert backoff.computed == [1, 2, 1, 2]
    assert backoff.resets == 1  # two reports of one connection, one reset
    assert [a.healthy for a in attempts] == [False, False, True, False]
    assert [a.failures for a in attempts] == [1, 2, 1, 2]


async def test_healthy_on_the_first_connection_still_resets_the_backoff() -> None:
    """The router consumer's rule: every delivering connection resets, outage or not."""
    script = Script(healthy_then(OSError("overflow")), None)
    sup, backoff, _sleeps, _attempts = supervise(script)
    await sup.run()
    assert backoff.computed == [1] and backoff.resets == 1


async def test_guarded_health_reports_only_reset_after_an_outage() -> None:
    """The sources' rule (``if sup.failures: sup.healthy()``): no reset without failures."""

    def guarded(step: object) -> Callable[[Supervisor], object]:
        def run(sup: Supervisor) -> object:
            if sup.failures:
                sup.healthy()
            return step

        return run

    script = Script(guarded(OSError("a")), guarded(OSError("b")), None)
    sup, backoff, _sleeps, _attempts = supervise(script)
    await sup.run()
    assert backoff.computed == [1, 1] and backoff.resets == 1


async def test_flat_retry_waits_the_first_step_and_leaves_the_count_alone() -> None:
    class Unavailable(Exception):
        pass

    def classify(error: Exception | None) -> Verdict:
        return Verdict.RETRY_FLAT if isinstance(error, Unavailable) else Verdict.RETRY

    script = Script(
        OSError("1"),
        OSError("2"),
        Unavailable(),
        Unavailable(),
        OSError("3"),
        None,
    )
    sup, backoff, _sleeps, attempts = supervise(script, classify)
    await sup.run()
    assert backoff.computed == [1, 2, 1, 1, 3]
    assert [(a.verdict, a.failures) for a in attempts] == [
        (Verdict.RETRY, 1),
        (Verdict.RETRY, 2),
        (Verdict.RETRY_FLAT, 2),
        (Verdict.RETRY_FLAT, 2),
        (Verdict.RETRY, 3),
    ]


async def test_fatal_reraises_the_very_error_without_waiting() -> None:
    class NotAllowed(Exception):
        pass

    error = NotAllowed("10.0.0.9 is not in allowed_publishers")

    def classify(exc: Exception | None) -> Verdict:
        return Verdict.FATAL if isinstance(exc, NotAllowed) else Verdict.RETRY

    script = Script(OSError("first"), error, None)
    sup, _backoff, sleeps, attempts = supervise(script, classify)
    with pytest.raises(NotAllowed) as caught:
        await sup.run()
    assert caught.value is error
    assert script.calls == 2 and sleeps.delays == [1.0] and len(attempts) == 1


async def test_fatal_after_a_clean_end_returns() -> None:
    script = Script(OSError("x"), None, None)

    def classify(exc: Exception | None) -> Verdict:
        return Verdict.FATAL if exc is None else Verdict.RETRY

    sup, _backoff, sleeps, _attempts = supervise(script, classify)
    await sup.run()
    assert script.calls == 2 and sleeps.delays == [1.0]


# -- stopping ----------------------------------------------------------------------------------


async def test_should_stop_before_the_first_connection_runs_none() -> None:
    script = Script(None)
    sup, _backoff, sleeps, _attempts = supervise(script, should_stop=lambda: True)
    await sup.run()
    assert script.calls == 0 and sup.attempts == 0 and sleeps.delays == []


async def test_stopping_during_a_connection_neither_reports_nor_waits() -> None:
    stopping = False
    classified: list[Exception | None] = []

    def drain(sup: Supervisor) -> object:
        nonlocal stopping
        stopping = True
        return OSError("cut by the drain")

    def classify(exc: Exception | None) -> Verdict:
        classified.append(exc)
        return Verdict.RETRY

    script = Script(OSError("first"), drain, None)
    sup, backoff, sleeps, attempts = supervise(script, classify, should_stop=lambda: stopping)
    await sup.run()
    assert script.calls == 2
    assert len(classified) == 2  # classified (it may log), but not counted or reported
    assert backoff.computed == [1] and sleeps.delays == [1.0] and len(attempts) == 1


async def test_stopping_during_the_wait_ends_before_the_next_connection() -> None:
    stopping = False

    async def sleep(delay: float) -> None:
        nonlocal stopping
        stopping = True

    script = Script(OSError("x"), None)
    sup = Supervisor(
        script, retry_all, backoff=NoBackoff(), sleep=sleep, should_stop=lambda: stopping
    )
    await sup.run()
    assert script.calls == 1


# -- cancellation ------------------------------------------------------------------------------


async def test_cancelled_error_from_run_once_propagates_unclassified() -> None:
    classified: list[Exception | None] = []

    def classify(exc: Exception | None) -> Verdict:
        classified.append(exc)
        return Verdict.RETRY

    script = Script(OSError("x"), asyncio.CancelledError(), None)
    sup, _backoff, sleeps, _attempts = supervise(script, classify)
    with pytest.raises(asyncio.CancelledError):
        await sup.run()
    assert len(classified) == 1 and sleeps.delays == [1.0]


async def test_cancelled_error_from_the_wait_propagates() -> None:
    async def sleep(delay: float) -> None:
        raise asyncio.CancelledError

    script = Script(OSError("x"), None)
    sup = Supervisor(script, retry_all, backoff=NoBackoff(), sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        await sup.run()
    assert script.calls == 1


async def test_cancelling_the_task_ends_it_in_a_connection_and_in_a_wait() -> None:
    """Real task cancellation: the supervisor's task ends cancelled from either await."""
    connected, waiting = asyncio.Event(), asyncio.Event()
    hold = asyncio.Event()  # never set

    async def connection() -> None:
        connected.set()
        await hold.wait()

    sup = Supervisor(connection, retry_all, backoff=NoBackoff())
    task = asyncio.create_task(sup.run())
    await asyncio.wait_for(connected.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def failing() -> None:
        raise OSError("refused")

    async def sleep(delay: float) -> None:
        waiting.set()
        await hold.wait()

    sup = Supervisor(failing, retry_all, backoff=NoBackoff(), sleep=sleep)
    task = asyncio.create_task(sup.run())
    await asyncio.wait_for(waiting.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sup.failures == 1


async def test_a_base_exception_is_not_classified() -> None:
    class Stop(BaseException):
        pass

    classified: list[Exception | None] = []

    def classify(error: Exception | None) -> Verdict:
        classified.append(error)
        return Verdict.RETRY

    script = Script(Stop())
    sup, *_ = supervise(script, classify)
    with pytest.raises(Stop):
        await sup.run()
    assert classified == []


# -- the loops that use it ---------------------------------------------------------------------


async def test_the_router_consumer_loop_fits() -> None:
    """``KvEventConsumer.run``: "unavailable" retries flat at the first step, a connection
    that applied an event resets, a clean end after delivering is INFO, the rest WARNING;
    ``reconnects`` counts every connection after the first."""

    class SourceUnavailable(Exception):
        pass

    class Consumer:
        def __init__(self, script: list[object]) -> None:
            self.script = script
            self.reconnects = 0
            self.applied_now = 0
            self.log: list[tuple[int, str, int]] = []
            self.backoff = LinearBackoff()
            self.sleeps = Sleeps()
            self.sup = Supervisor(
                self.run_once,
                self.classify,
                backoff=self.backoff,
                sleep=self.sleeps,
                on_retry=self.on_retry,
                should_stop=lambda: not self.script,
            )

        async def run_once(self) -> None:
            if self.sup.attempts > 1:
                self.reconnects += 1
            self.applied_now = 0
            step = self.script.pop(0)
            if step == "deliver":
                self.applied_now += 1
                self.sup.healthy()
                return
            if isinstance(step, Exception):
                raise step

        def classify(self, exc: Exception | None) -> Verdict:
            if isinstance(exc, SourceUnavailable):
                return Verdict.RETRY_FLAT
            return Verdict.RETRY

        def on_retry(self, a: Attempt) -> None:
            if a.verdict is Verdict.RETRY_FLAT:
                self.log.append((logging.DEBUG, str(a.error), a.failures))
                return
            why = "stream ended" if a.error is None else str(a.error)
            clean = a.error is None and self.applied_now
            self.log.append((logging.INFO if clean else logging.WARNING, why, a.failures))

    c = Consumer(
        [
            SourceUnavailable("no session"),
            SourceUnavailable("no session"),
            OSError("503"),
            OSError("503"),
            OSError("503"),
            "deliver",
            OSError("404"),
            "last",
        ]
    )
    await c.sup.run()
    assert c.backoff.computed == [1, 1, 1, 2, 3, 1, 2]
    assert c.backoff.resets == 1
    assert c.reconnects == 7
    assert c.log == [
        (logging.DEBUG, "no session", 0),
        (logging.DEBUG, "no session", 0),
        (logging.WARNING, "503", 1),
        (logging.WARNING, "503", 2),
        (logging.WARNING, "503", 3),
        (logging.INFO, "stream ended", 1),
        (logging.WARNING, "404", 2),
    ]


async def test_the_push_client_log_levels_fit() -> None:
    """``EventBusClient.run``: the first failure of an outage and every tenth are warnings,
    a welcomed session the router ended as UNAVAILABLE is routine."""
    levels: list[tuple[int, int]] = []

    def on_retry(a: Attempt) -> None:
        level = logging.WARNING if a.failures == 1 or a.failures % 10 == 0 else logging.INFO
        if a.healthy and str(a.error).startswith("UNAVAILABLE"):
            level = logging.INFO
        levels.append((a.failures, level))

    steps: list[object] = [OSError("refused")] * 11
    steps += [healthy_then(OSError("UNAVAILABLE: router restarting")), OSError("refused"), None]
    script = Script(*steps)
    sup, *_ = supervise(script, on_retry=on_retry)
    await sup.run()
    warned = [f for f, level in levels if level == logging.WARNING]
    assert warned == [1, 10]  # after the healthy session the count starts again at 1
    assert levels[11] == (1, logging.INFO)
