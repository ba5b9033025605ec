"""Anthropic prompt-caching marker injection.

Anthropic caches a prompt prefix only up to a block marked ``cache_control``. Marking
the last system block lets the provider's cache complement the router's own
affinity. Precedence (reference docs): the backend's ``anthropic_auto_cache_control``
(default true) decides, unless ``prefix_routing.anthropic_cache_control_injection`` forces
injection for every backend. A caller that placed any marker itself is left untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["has_cache_control", "inject_cache_control", "should_inject"]

_EPHEMERAL = {"type": "ephemeral"}


def should_inject(force: bool, backend_auto: bool) -> bool:
    return force or backend_auto


def _blocks_have_marker(blocks: Any) -> bool:
    if not isinstance(blocks, list):
        return False
    return any(isinstance(b, Mapping) and "cache_control" in b for b in blocks)


def has_cache_control(body: Mapping[str, Any]) -> bool:
    """Whether the caller already marked anything in system, messages or tools."""
    if _blocks_have_marker(body.get("system")):
        return True
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, Mapping) and (
                "cache_control" in m or _blocks_have_marker(m.get("content"))
            ):
                return True
    return _blocks_have_marker(body.get("tools"))


def inject_cache_control(body: dict[str, Any]) -> bool:
    """Mark the last system block in place; returns whether the body changed."""
    system = body.get("system")
    if not system or has_cache_control(body):
        return False
    if isinstance(system, str):
        body["system"] = [{"type": "text", "text": system, "cache_control": dict(_EPHEMERAL)}]
        return True
    if isinstance(system, list) and isinstance(system[-1], dict):
        system[-1]["cache_control"] = dict(_EPHEMERAL)
        return True
    return False
