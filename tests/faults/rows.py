"""The rows of the fault matrix. The procedure every row follows, and how each figure is
measured, is in ``procedure.py``; a group of rows that needs its own machinery (a proxy, a
second router) lives in its own ``rows_<group>.py`` and is listed in ``GROUPS`` below."""

from __future__ import annotations

from .procedure import Row
from .rows_abuse import ABUSE
from .rows_checkpoint import CHECKPOINT
from .rows_h2 import H2
from .rows_multi import MULTI
from .rows_net import NET
from .stack import FaultStack, StackOptions

__all__ = ["ROWS"]


# -- the rows ----------------------------------------------------------------------------


async def _kill_listener(s: FaultStack) -> None:
    await s.kill_listener()


async def _start_listener(s: FaultStack) -> None:
    await s.start_listener()


async def _kill_engine(s: FaultStack) -> None:
    await s.kill_engine(0)


async def _start_engine(s: FaultStack) -> None:
    await s.start_engine(0)


async def _kill_router(s: FaultStack) -> None:
    await s.kill_router()


async def _start_router(s: FaultStack) -> None:
    await s.start_router()


async def _kill_redis(s: FaultStack) -> None:
    await s.kill_redis()


async def _start_redis(s: FaultStack) -> None:
    await s.start_redis()


async def _pause_redis(s: FaultStack) -> None:
    await s.pause_redis()


async def _resume_redis(s: FaultStack) -> None:
    await s.resume_redis()


async def _nothing(s: FaultStack) -> None:
    return None


def _router_kill(kind: str, after: str, opts: StackOptions) -> Row:
    """The one router SIGKILLed and started again: requests meanwhile fail, unavoidably."""
    return Row(
        f"router-kill/{kind}",
        f"router SIGKILL 2 s, {after}",
        opts,
        _kill_router,
        _start_router,
        unavoidable=True,
        router_restarts=True,
        notes=("one router replica: requests while it is down have nowhere to go",),
    )


CORE: tuple[Row, ...] = (
    Row(
        "baseline",
        "none (the harness's own floor)",
        StackOptions(),
        _nothing,
        _nothing,
        notes=("no fault: any figure here is the harness's, not a fault's",),
    ),
    Row(
        "listener-kill/replay",
        "listener SIGKILL 2 s, restart (pull); engines replay all",
        StackOptions(replay=True, buffer_steps=10_000),
        _kill_listener,
        _start_listener,
        listener_restarts=True,
    ),
    Row(
        "listener-kill/short-replay",
        "listener SIGKILL 2 s, restart (pull); replay buffer 8 batches; checkpoints",
        StackOptions(replay=True, buffer_steps=8, checkpoint=True),
        _kill_listener,
        _start_listener,
        listener_restarts=True,
    ),
    Row(
        "listener-kill/no-replay",
        "listener SIGKILL 2 s, restart (pull); no replay socket; checkpoints",
        StackOptions(replay=False, checkpoint=True),
        _kill_listener,
        _start_listener,
        listener_restarts=True,
    ),
    Row(
        "listener-kill/push",
        "listener SIGKILL 2 s, restart (push, event bus); engines replay all",
        StackOptions(transport="push"),
        _kill_listener,
        _start_listener,
        listener_restarts=True,
    ),
    Row(
        "engine-kill",
        "sim-1 SIGKILL 2 s, restart empty (seq from 0)",
        StackOptions(),
        _kill_engine,
        _start_engine,
    ),
    Row(
        "engine-kill/no-replay",
        "sim-1 SIGKILL 2 s, restart empty; no replay socket",
        StackOptions(replay=False),
        _kill_engine,
        _start_engine,
    ),
    _router_kill("memory", "restart (memory index)", StackOptions()),
    _router_kill("redis", "restart (Redis index, kept)", StackOptions(index="redis")),
    _router_kill(
        "push", "restart (push: the listener dials again)", StackOptions(transport="push")
    ),
    Row(
        "redis-pause",
        "Redis SIGSTOP 2 s, SIGCONT (KV index and response cache; commands time out, data kept)",
        StackOptions(index="redis"),
        _pause_redis,
        _resume_redis,
    ),
    Row(
        "redis-kill",
        "Redis SIGKILL 2 s, restart empty (KV index and response cache on it)",
        StackOptions(index="redis"),
        _kill_redis,
        _start_redis,
    ),
)

#: Every group of rows, in the order the table shows them.
GROUPS: tuple[tuple[Row, ...], ...] = (CORE, CHECKPOINT, NET, H2, ABUSE, MULTI)

ROWS: dict[str, Row] = {row.name: row for group in GROUPS for row in group}
