"""Every router and listener config the deploy/k8s overlays embed starts the real process,
and the path its pod probes answers 200 there.

The pod's files are laid out as the kubelet would mount them (the Secrets' tokens, and for
cert-manager's Secrets real certificates from ``certs.pki`` for each Certificate's names
and usages), the config's paths re-rooted onto them, and only the addresses moved to
loopback ports of this machine (``0.0.0.0:8080`` -> ``127.0.0.1:0``, the DaemonSet
listener's ZMQ bind to a free loopback port): what the test changes is where the process
binds, nothing it reads. The hosts the configs dial (``redis``, ``vllm-1``,
``continuum-router-bus``) do not resolve here, which the processes ride out as they would
an outage: the Redis fallback, the consumers' and the bus client's reconnects.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from harness.procs import free_port, launch, python_module
from tests.k8s_support import (
    OVERLAYS,
    CertManagerStandIn,
    config_text,
    continuum_containers,
    lay_out,
    mounted_files,
    render,
    reroot,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
]

NODE = "gpu-node-a"


def _to_loopback(program: str, config: dict[str, Any]) -> dict[str, Any]:
    if program == "continuum-router":
        config["server"]["listen"] = "127.0.0.1:0"
        bus = config.get("dynamo", {}).get("event_bus")
        if bus:
            bus["listen"] = f"127.0.0.1:{free_port()}"
    else:
        config["listen"] = "127.0.0.1:0"
        for s in config["sources"]:
            if s.get("zmq_mode") == "bind":
                s["zmq_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
    return config


@pytest.mark.parametrize("overlay", OVERLAYS)
async def test_every_embedded_config_runs_and_answers_its_probe(
    overlay: str, tmp_path: Path
) -> None:
    objs = render(overlay, tmp_path / "render")
    issue = CertManagerStandIn(tmp_path)
    containers = continuum_containers(objs)
    answered: list[str] = []
    for i, c in enumerate(containers):
        root = tmp_path / f"pod{i}"
        lay_out(mounted_files(objs, c.pod, c.container, issue), root)
        config = _to_loopback(c.program, reroot(yaml.safe_load(config_text(objs, c, NODE)), root))
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = (
            python_module("router", "serve", "--config", str(path))
            if c.program == "continuum-router"
            else python_module("listener", "--config", str(path))
        )
        child = await launch(c.name, argv, ready_timeout=60, log=root / "process.log")
        try:
            probes = {
                c.container[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")
            }
            async with aiohttp.ClientSession() as session:
                for probe in probes:
                    async with session.get(child.ready.url() + probe) as r:
                        assert r.status == 200, c.name
                        assert (await r.json())["status"] == "ok", c.name
            answered.append(c.name)
        finally:
            await child.stop()
    assert answered == [c.name for c in containers] and len(answered) >= 2
