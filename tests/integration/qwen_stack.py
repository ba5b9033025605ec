"""Config pieces of the conversation-mode stacks the integration tests run on Qwen2.

Simulated engines (``SimFleet(tokenizer="qwen2")``) publish vLLM KV events on loopback
ZeroMQ ports; the listener reads them with Qwen2's ``tokenizer.json`` (conversation mode
needs the token ids turned into chain keys), and the router renders requests with Qwen2's
chat template. These helpers say that once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.procs import free_port
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json

__all__ = ["listener_sources", "qwen2_templates", "qwen_fleet"]


def qwen_fleet(names: Sequence[str], model: str) -> tuple[SimFleet, dict[str, Any]]:
    """Engines (not started: ``async with`` the fleet) publishing vLLM KV events on fresh
    ports, and the config of a conversation-mode listener reading them."""
    ports = [free_port() for _ in names]
    fleet = SimFleet(
        n=len(names),
        model=model,
        names=list(names),
        tokenizer="qwen2",
        kv_events_format="vllm-0.33",
        overrides={i: {"kv_events": f"tcp://*:{pub}"} for i, pub in enumerate(ports)},
    )
    listener = {
        "listen": "127.0.0.1:0",
        "conversation": {"enabled": True},
        "sources": listener_sources(dict(zip(names, ports, strict=True)), model),
    }
    return fleet, listener


def listener_sources(publishers: Mapping[str, int], model: str) -> list[dict[str, Any]]:
    """The listener's ``sources``: for each backend name, a vLLM source connecting to its
    engine's ZMQ PUB port on 127.0.0.1, with Qwen2's tokenizer."""
    return [
        {
            "backend_name": name,
            "engine": "vllm",
            "zmq_endpoint": f"tcp://127.0.0.1:{port}",
            "zmq_mode": "connect",
            "allowed_publishers": ["127.0.0.1"],
            "model": model,
            "tokenizer": str(bundled_qwen2_json()),
        }
        for name, port in publishers.items()
    ]


def qwen2_templates(model: str) -> list[dict[str, Any]]:
    """The router's ``kv_cache_index.conversation.templates`` for the simulator's model."""
    return [
        {
            "model": model,
            "tokenizer_config": str(bundled_qwen2_config()),
            "tokenizer": str(bundled_qwen2_json()),
        }
    ]
