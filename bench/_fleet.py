"""The process stack of the fleet benchmarks and the demo: engines, listener, routers.

Simulated engines (:class:`harness.sim.fleet.SimFleet`, Qwen2 tokenizer and chat template,
KV events over ZMQ in vLLM's format), the real ``continuum-kv-listener`` subscribed to
all of them, and real router processes, one per configuration, on generated configs.
Waiting is always on a condition (a READY line, a stats field), never a fixed sleep.

Conversation-depth routing is opt-in on both sides (``conversation`` in the listener's
config and ``kv_cache_index.conversation`` in the router's). A tree whose listener or
router does not support it yet is detected, not assumed: :func:`listener_conversation`
validates a listener config that turns it on (``--check``: unknown keys are errors),
:func:`router_conversation` validates the router config (``config validate``) and
:func:`routes_conversation` asks a running router's ``/admin/kv-index/stats`` for its
conversation section. A bench reports the rows that need it as "not available" when a
probe says no, and runs the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from harness.procs import ROOT, Service, free_port
from harness.sim.fleet import SimFleet

__all__ = [
    "MODEL",
    "ListenerProcess",
    "PushMode",
    "RouterProcess",
    "admin_stats",
    "demo_fleet",
    "kv_consumers_connected",
    "listener_cleared",
    "listener_config",
    "listener_connected",
    "listener_conversation",
    "predicted_vs_delivered",
    "qwen_files",
    "router_config",
    "router_conversation",
    "routes_conversation",
    "scoring_arg",
]

MODEL = "demo-model"


def scoring_arg(value: str) -> dict[str, float]:
    """``--scoring k=v,k=v``: the conversation row's ``kv_cache_index.conversation.scoring``
    overrides (the cost model's weights and the bounded-load cap), to measure a setting
    against the defaults in the same run."""
    out: dict[str, float] = {}
    for kv in filter(None, value.split(",")):
        name, sep, num = kv.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{kv!r} is not name=value")
        try:
            out[name.strip()] = float(num)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kv!r}: {num!r} is not a number") from None
    return out


def qwen_files() -> tuple[Path, Path]:
    """The Qwen2 ``tokenizer.json`` and ``tokenizer_config.json`` the engines use."""
    from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json

    return bundled_qwen2_json(), bundled_qwen2_config()


def demo_fleet(engines: int, capacity_blocks: int, zmq_ports: list[int]) -> SimFleet:
    """The demos' engines: Qwen2 tokenizer, a modelled prefill time, a prefix cache of
    ``capacity_blocks`` each, vLLM KV events bound on ``zmq_ports``."""
    return SimFleet(
        n=engines,
        model=MODEL,
        names=[f"engine-{i + 1}" for i in range(engines)],
        capacity_blocks=capacity_blocks,
        latency=True,
        tokenizer="qwen2",
        kv_events_format="vllm-0.33",
        overrides={i: {"kv_events": f"tcp://*:{p}"} for i, p in enumerate(zmq_ports)},
    )


def RouterProcess(config: dict[str, Any], workdir: Path, log: Path | None = None) -> Service:
    # Logs go to this terminal (log=None) at WARNING: what goes wrong shows as it happens.
    return Service(
        "router",
        ["router", "--log-level", "WARNING", "serve"],
        config,
        workdir / "router.yaml",
        log=log,
        ready_timeout=30,
    )


def ListenerProcess(config: dict[str, Any], workdir: Path, log: Path | None = None) -> Service:
    # ERROR, not WARNING: the listener starts before the first router, and between two runs
    # no router serves the bus, so its reconnect warnings are expected here.
    return Service(
        "listener",
        ["listener", "--log-level", "ERROR"],
        config,
        workdir / "listener.yaml",
        log=log,
        ready_timeout=30,
    )


@dataclass(frozen=True)
class PushMode:
    """The event bus every router of the demo serves on one port, and the listener dials."""

    bus_port: int
    pki: dict[str, Any]
    client_id: str = "demo-listener"

    @classmethod
    def make(cls, workdir: Path) -> PushMode:
        from certs import dev_bundle

        return cls(free_port(), dev_bundle(workdir / "pki", clients=["demo-listener"]))

    def router_section(self, names: list[str]) -> dict[str, Any]:
        return {
            "enabled": True,
            "listen": f"127.0.0.1:{self.bus_port}",
            "tls": {
                "cert": str(self.pki["server"].cert),
                "key": str(self.pki["server"].key),
                "client_ca": str(self.pki["ca"].cert),  # mTLS: client certificates required
            },
            "brokers": [{"id": self.client_id, "role": "kv_listener", "backends": names}],
        }

    def listener_section(self) -> dict[str, Any]:
        cert = self.pki[self.client_id]
        return {
            "url": f"https://localhost:{self.bus_port}",
            "ca_file": str(self.pki["ca"].cert),
            "client_id": self.client_id,
            "client_cert_file": str(cert.cert),
            "client_key_file": str(cert.key),
            "reconnect_backoff": "100ms",
        }


def listener_config(
    fleet: SimFleet,
    zmq_ports: list[int],
    push: PushMode | None = None,
    conversation: bool = False,
) -> dict[str, Any]:
    """One source per engine: SUB connects to the engine's bound PUB (vLLM's default).
    ``conversation``: also track the chains' prompt keys (needs the tokenizer's bytes)."""
    tokenizer = str(qwen_files()[0])
    cfg: dict[str, Any] = {
        **({"event_bus": push.listener_section()} if push is not None else {}),
        "listen": "127.0.0.1:0",
        "sources": [
            {
                "backend_name": name,
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{port}",
                "zmq_mode": "connect",
                "allowed_publishers": ["127.0.0.1"],
                "detokenize_endpoint": f"{url}/detokenize",
                "model": MODEL,
                "chat_template": "chatml",
                **({"tokenizer": tokenizer} if conversation else {}),
            }
            for name, url, port in zip(fleet.names, fleet.urls, zmq_ports, strict=True)
        ],
    }
    if conversation:
        cfg["conversation"] = {"enabled": True}
    return cfg


def router_config(
    base: Mapping[str, Any],
    fleet: SimFleet,
    strategy: str,
    port: int,
    listener_url: str | None = None,
    push: PushMode | None = None,
    conversation: bool = False,
) -> dict[str, Any]:
    """``base`` with the fleet as backends; ``listener_url``: Tier 4 fed by the listener
    (pull over SSE, or the event bus with ``push``); ``conversation``: the conversation
    index too, with the engines' chat template."""
    cfg = dict(base)
    cfg["server"] = {**base.get("server", {}), "listen": f"127.0.0.1:{port}"}
    cfg["selection_strategy"] = strategy
    cfg["backends"] = [
        {"name": name, "url": url, "type": "vllm", "models": [MODEL]}
        for name, url in zip(fleet.names, fleet.urls, strict=True)
    ]
    if push is not None:
        # Every router serves the bus (so the listener stays connected between runs).
        cfg["dynamo"] = {"event_bus": push.router_section(list(fleet.names))}
    if listener_url is not None:
        cfg["kv_cache_index"] = {
            "enabled": True,
            "event_sources": [
                {"backend_name": n, "transport": "event_bus", "reconnect_interval_ms": 100}
                if push is not None
                else {"backend_name": n, "endpoint": f"{listener_url}/events/{n}"}
                for n in fleet.names
            ],
        }
    if conversation:
        tokenizer, tokenizer_config = qwen_files()
        index = cfg.setdefault("kv_cache_index", {"enabled": True})
        index["conversation"] = {
            "enabled": True,
            "templates": [
                {
                    "model": MODEL,
                    "tokenizer_config": str(tokenizer_config),
                    "tokenizer": str(tokenizer),
                }
            ],
        }
    return cfg


async def listener_connected(listener: Service, fleet: SimFleet) -> None:
    """Send each engine a request until the listener has a frame from every engine.

    ZMQ's slow joiner: what an engine publishes before the SUB is connected is lost.
    """
    async with aiohttp.ClientSession() as session:
        for attempt in range(200):
            async with session.get(listener.url + "/stats") as resp:
                sources = (await resp.json())["sources"]
            waiting = [n for n in fleet.names if sources[n]["frames"] == 0]
            if not waiting:
                return
            for i, name in enumerate(fleet.names):
                if name in waiting:
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": f"warm-up {attempt} " * 40}],
                    }
                    async with session.post(fleet.urls[i] + "/v1/chat/completions", json=body):
                        pass
            await asyncio.sleep(0.05)
    raise RuntimeError("the listener received nothing from the engines")


async def listener_cleared(listener: Service, names: list[str], within: float = 20.0) -> None:
    """Wait until the listener tracks no block of any engine (after a fleet reset: the
    engines' ``AllBlocksCleared`` reached it), so the next run starts from nothing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(listener.url + "/stats") as resp:
                sources = (await resp.json())["sources"]
            if all(sources[n].get("tracked_blocks", 0) == 0 for n in names):
                return
            if loop.time() > deadline:
                raise RuntimeError(f"the listener still tracks blocks: {sources}")
            await asyncio.sleep(0.05)


async def kv_consumers_connected(router: Service, names: list[str]) -> None:
    """Wait until the router's event consumers are attached to the listener's streams."""
    async with aiohttp.ClientSession() as session:
        for _ in range(400):
            async with session.get(router.url + "/admin/kv-index/backends") as resp:
                backends = (await resp.json())["backends"]
            if len(backends) == len(names) and all(b["connection"]["connected"] for b in backends):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError("the router did not connect to the listener's event streams")


async def admin_stats(router: Service) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(router.url + "/admin/kv-index/stats") as resp,
    ):
        data: dict[str, Any] = await resp.json()
        return data


def _run_ok(argv: list[str], cfg: dict[str, Any], name: str) -> str | None:
    """Run a config checker on ``cfg``; None if it accepts it, else its complaint."""
    with tempfile.TemporaryDirectory(prefix="continuum-probe-") as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        done = subprocess.run(
            [sys.executable, "-m", *[a.replace("{path}", str(path)) for a in argv]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    if done.returncode == 0:
        return None
    lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    return lines[0] if lines else f"exit status {done.returncode}"


async def listener_conversation(cfg: dict[str, Any]) -> str | None:
    """None when the listener accepts ``cfg`` (a conversation-mode config), else why not."""
    return await asyncio.to_thread(
        _run_ok, ["listener", "--config", "{path}", "--check"], cfg, "listener.yaml"
    )


async def router_conversation(cfg: dict[str, Any]) -> str | None:
    """None when the router accepts ``cfg`` (``config validate``), else why not."""
    return await asyncio.to_thread(
        _run_ok, ["router", "config", "validate", "{path}"], cfg, "router.yaml"
    )


def _conversation_section(stats: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for key, value in stats.items():
        if "conversation" in key and isinstance(value, Mapping):
            return value
    return None


async def routes_conversation(router: Service) -> str | None:
    """None when a running router reports a conversation index in its KV index stats."""
    try:
        stats = await admin_stats(router)
    except (aiohttp.ClientError, ValueError) as exc:
        return f"/admin/kv-index/stats: {exc}"
    if _conversation_section(stats) is None:
        return "the router's /admin/kv-index/stats has no conversation section"
    return None


def _numbers(obj: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(obj, Mapping):
        return [kv for k, v in obj.items() for kv in _numbers(v, f"{path}.{k}")]
    if isinstance(obj, bool):
        return []
    if isinstance(obj, int | float):
        return [(path, float(obj))]
    return []


def predicted_vs_delivered(stats: Mapping[str, Any]) -> float | None:
    """Relative error of the cached tokens the router predicted against those the engines
    reported, from its stats' conversation section: ``|sum predicted - sum delivered| /
    sum delivered`` over the counters named ``*predicted*`` and ``*delivered*``
    (``*reported*``). None when the router reports no such counters."""
    section = _conversation_section(stats)
    if section is None:
        return None
    predicted = delivered = 0.0
    for path, value in _numbers(section):
        leaf = path.rsplit(".", 1)[-1]
        if "predicted" in leaf and "token" in leaf:
            predicted += value
        elif ("delivered" in leaf or "reported" in leaf) and "token" in leaf:
            delivered += value
    if delivered <= 0:
        return None
    return abs(predicted - delivered) / delivered
