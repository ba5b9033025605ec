"""Listener restarts with checkpoints, separating what a checkpoint keeps from what no
checkpoint can give back.

``listener-kill/no-replay`` (core) measures the engines' holdings from before the outage:
its tenants were all served before the fault, so during the 2 s the engines only hit
their caches and store new question blocks under prefixes the checkpoint holds. The row
here adds a tenant served for the first time *during* the outage: with no replay socket
its prefix reaches the listener never (its later requests are cache hits whose blocks
hang under the unknown prefix: orphans), so its pair is lost, and that is what the
figure measures. The listener counts it (``gap_batches``) and flags the backend
(``view_incomplete``, ``"incomplete": true`` on its resyncs); it invents nothing. Pairs
first held during the outage are reported as an expected loss (``Row.outage_loss``);
any other lost pair is still a defect.
"""

from __future__ import annotations

from tests.integration.conftest import http

from .procedure import Row
from .stack import FaultStack, StackOptions
from .traffic import tenant_body

__all__ = ["CHECKPOINT"]

NEW_TENANT = 1000
"""A tenant the row's client traffic never uses (it cycles through ``Traffic.tenants``)."""


async def _kill_listener_then_serve_a_new_tenant(s: FaultStack) -> None:
    await s.kill_listener()
    assert s.router is not None
    for n in range(3):
        r = await http(
            "POST", s.router.url + "/v1/chat/completions", json=tenant_body(NEW_TENANT, n)
        )
        assert r.status == 200, r


async def _start_listener(s: FaultStack) -> None:
    await s.start_listener()


CHECKPOINT: tuple[Row, ...] = (
    Row(
        "listener-kill/no-replay/new-prefix",
        "as listener-kill/no-replay, and a new tenant first served during the outage",
        StackOptions(replay=False, checkpoint=True),
        _kill_listener_then_serve_a_new_tenant,
        _start_listener,
        listener_restarts=True,
        outage_loss=(
            "stored only while the listener was down, and no replay socket gives their "
            "events back (a relearn has nothing to ask; later cache hits hang their blocks "
            "under the unknown prefix: orphans); every pair held before the outage is kept"
        ),
    ),
)
