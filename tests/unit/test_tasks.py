"""bus.tasks.cancel_and_wait: the task's own ending is swallowed, the caller's cancellation
is not."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bus.tasks import cancel_and_wait

TIMEOUT = 5.0


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_a_cancelled_task_is_waited_for_and_its_cancellation_swallowed() -> None:
    tasks = [asyncio.create_task(_forever()) for _ in range(3)]
    await asyncio.sleep(0)
    await cancel_and_wait(*tasks, None)
    assert all(t.cancelled() for t in tasks)


async def test_a_task_that_fails_on_the_way_out_is_swallowed_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def cleanup_fails() -> None:
        try:
            await _forever()
        finally:
            raise RuntimeError("cleanup failed")

    quiet = asyncio.create_task(cleanup_fails())
    loud = asyncio.create_task(cleanup_fails(), name="loud")
    await asyncio.sleep(0)
    log = logging.getLogger("test.tasks")
    with caplog.at_level(logging.ERROR, logger="test.tasks"):
        await cancel_and_wait(quiet)
        await cancel_and_wait(loud, log=log)
    assert isinstance(quiet.exception(), RuntimeError)
    records = [r for r in caplog.records if r.name == "test.tasks"]
    assert len(records) == 1 and "loud" in records[0].getMessage()
    assert records[0].exc_info is not None and records[0].exc_info[0] is RuntimeError


async def test_futures_that_already_ended_are_fine() -> None:
    async def boom() -> None:
        raise ValueError("early")

    async def ok() -> int:
        return 1

    failed = asyncio.gather(boom())
    done = asyncio.create_task(ok())
    await asyncio.wait([failed, done])  # type: ignore[type-var]
    await cancel_and_wait(failed, done)
    assert done.result() == 1


async def test_the_callers_own_cancellation_propagates() -> None:
    """The old ``suppress(CancelledError)`` swallowed this one: the caller went on."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        try:
            await _forever()
        except asyncio.CancelledError:
            entered.set()
            await release.wait()  # takes its time to stop

    child = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    went_on = False

    async def stopper() -> None:
        nonlocal went_on
        await cancel_and_wait(child)
        went_on = True

    caller = asyncio.create_task(stopper())
    await asyncio.wait_for(entered.wait(), TIMEOUT)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert caller.cancelled() and not went_on
    release.set()
    await asyncio.wait_for(child, TIMEOUT)


async def test_stopping_in_a_finally_of_a_cancelled_caller_still_stops_the_tasks() -> None:
    started = asyncio.Event()
    child = asyncio.create_task(_forever())
    seen: list[bool] = []

    async def owner() -> None:
        try:
            started.set()
            await _forever()
        finally:
            await cancel_and_wait(child)
            seen.append(child.cancelled())

    task = asyncio.create_task(owner())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [True]


async def test_grace_lets_a_finishing_task_end_on_its_own() -> None:
    finish = asyncio.Event()

    async def finishes() -> str:
        await finish.wait()
        return "done"

    task = asyncio.create_task(finishes())
    finish.set()
    await cancel_and_wait(task, grace=TIMEOUT)
    assert task.result() == "done"


async def test_grace_then_cancel_a_task_that_does_not_finish() -> None:
    task = asyncio.create_task(_forever())
    await cancel_and_wait(task, grace=0.01)
    assert task.cancelled()


async def test_cancelling_the_caller_during_the_grace_cancels_the_tasks() -> None:
    child = asyncio.create_task(_forever())
    caller = asyncio.create_task(cancel_and_wait(child, grace=TIMEOUT))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(child, TIMEOUT)
    assert child.cancelled()


async def test_a_task_that_lost_its_cancellation_is_cancelled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Python 3.11's ``wait_for`` returns its operation's result when the cancellation
    arrives in the same loop iteration, and the task goes on; waiting once would hang."""
    pending: list[asyncio.Future[int]] = []
    writing = asyncio.Event()

    async def operation() -> int:
        pending.append(asyncio.get_running_loop().create_future())
        writing.set()
        return await pending[-1]

    async def writes_forever() -> None:
        while True:
            await asyncio.wait_for(operation(), TIMEOUT)  # as redis-py wraps each write

    task = asyncio.create_task(writes_forever(), name="writer")
    await asyncio.wait_for(writing.wait(), TIMEOUT)
    pending[-1].set_result(1)  # the write completes as the stop arrives
    with caplog.at_level(logging.WARNING, logger="continuum.tasks"):
        await asyncio.wait_for(cancel_and_wait(task), TIMEOUT)
    assert task.cancelled()
    if len(pending) > 1:  # the cancellation was lost (3.11), and the task was told again
        assert any("writer" in r.getMessage() for r in caplog.records)
