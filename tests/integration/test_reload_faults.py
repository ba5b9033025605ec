"""A config file that is not even text (not UTF-8) on reload: rejected, logged and counted
like any invalid file, by the file watcher and by SIGHUP alike; the watcher keeps
watching, and SIGTERM afterwards still drains the requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import yaml

from harness.sim.fleet import SimFleet

from .conftest import (
    MakeFaultProxy,
    RouterProc,
    StartRouter,
    backend,
    metric_value,
    wait_until,
)

DELAY_MS = 1500


def write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def not_utf8(router: RouterProc) -> bytes:
    """The running file with a Latin-1 comment: valid YAML once decoded, but not UTF-8."""
    return router.config_path.read_bytes() + b"# caf\xe9 (Latin-1)\n"


async def reloads(router: RouterProc, result: str) -> float:
    return metric_value(await router.metrics(), "continuum_config_reloads_total", result=result)


async def test_a_non_utf8_file_is_rejected_and_the_router_keeps_watching_and_draining(
    start_router: StartRouter, sims: SimFleet, fault_proxy: MakeFaultProxy
) -> None:
    slow = await fault_proxy(sims[0].url, {"x-sim-delay-ms": str(DELAY_MS)})
    cfg: dict[str, Any] = {
        "prefix_routing": {"enabled": True, "virtual_nodes": 150},
        "health_check": {"interval_ms": 60_000},
        "backends": [backend("slowpoke", slow.url, models=["demo-model"])],
    }
    router = await start_router(cfg)

    # The watcher sees the change.
    write_bytes(router.config_path, not_utf8(router))
    await router.wait_for_log("reload (file changed) rejected: keeping the running config")
    assert "UTF-8" in router.log()
    assert await reloads(router, "rejected") == 1

    # It is still watching: a valid edit is applied without a signal.
    new = {**cfg, "prefix_routing": {"enabled": True, "virtual_nodes": 33}}
    router.write_config(new)
    await router.wait_prefix_config(new, within=5)
    assert await reloads(router, "applied") == 1

    # SIGHUP on the same kind of file.
    write_bytes(router.config_path, not_utf8(router))

    async def rejected(n: int) -> bool:
        return await reloads(router, "rejected") >= n

    await wait_until(lambda: rejected(2), 5.0, what="the watcher to reject the file again")
    router.proc.send_signal(signal.SIGHUP)
    await wait_until(lambda: rejected(3), 5.0, what="the SIGHUP reload to be rejected")
    assert "reload (SIGHUP) rejected" in router.log()
    assert (await router.chat()).status == 200
    assert (await router.stats())["config"]["virtual_nodes"] == 33

    # SIGTERM: the request in flight still gets its answer, and the router exits 0.
    pending = asyncio.ensure_future(router.chat())

    async def in_flight() -> bool:
        return (await router.in_flight()).get("slowpoke") == 1

    await wait_until(in_flight, what="the slow request in flight")
    router.proc.send_signal(signal.SIGTERM)
    assert (await pending).status == 200
    assert await asyncio.wait_for(router.proc.wait(), 15) == 0
    assert "Traceback" not in router.log(), router.log()


def test_the_yaml_reader_names_a_non_utf8_file(tmp_path: Path) -> None:
    from bus.config import ConfigError, read_yaml

    path = tmp_path / "bad.yaml"
    path.write_bytes(yaml.safe_dump({"a": 1}).encode() + b"# \xff\n")
    try:
        read_yaml(path)
    except ConfigError as exc:
        (issue,) = exc.issues
        assert issue.path == "(file)" and "UTF-8" in issue.message and str(path) in issue.message
    else:
        raise AssertionError("a non-UTF-8 file must be a ConfigError")
