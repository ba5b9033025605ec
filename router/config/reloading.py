"""What a hot reload applies and what waits for a restart, field by field.

Every leaf field of :class:`~router.config.models.RouterConfig` is named here by its YAML
path (list items as ``[]``), in exactly one of :data:`RELOADABLE` and
:data:`RESTART_ONLY`; ``tests/unit/test_reload_classes.py`` walks the models and fails
on a field named in neither, so a new field cannot be added without deciding. README's
hot-reload paragraph is generated from the two lists (:func:`readme_summary`).

A restart-only field owns something built once: a socket, a connection pool, an index,
a background task. A reload that changes one logs a warning naming its path and keeps the
running value; the rest of the file applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .models import RouterConfig

__all__ = [
    "RELOADABLE",
    "RESTART_ONLY",
    "keep_restart_only",
    "readme_summary",
    "restart_only_changes",
]

RELOADABLE: tuple[str, ...] = (
    # The pool keeps unchanged backends' live state; a new one starts unprobed.
    "backends[].name",
    "backends[].url",
    "backends[].type",
    "backends[].models",
    "backends[].weight",
    "backends[].enabled",
    "backends[].internal",
    "backends[].api_key_env",
    "backends[].health_path",
    "backends[].anthropic_auto_cache_control",
    "backends[].cache_salt",
    "selection_strategy",
    "health_check.enabled",
    "health_check.interval_ms",
    "health_check.timeout_ms",
    "health_check.unhealthy_threshold",
    "health_check.healthy_threshold",
    "health_check.ejection_cooldown_ms",
    # Read per request; the ring is rebuilt on a virtual_nodes change. With
    # kv_cache_index.enabled, Tier 4 is built at start and consulted while enabled is true.
    "prefix_routing.enabled",
    "prefix_routing.max_prefix_length",
    "prefix_routing.load_factor_epsilon",
    "prefix_routing.virtual_nodes",
    "prefix_routing.anthropic_cache_control_injection",
    # Turned on at reload, the cache is built then (on the running backend and pool).
    "response_cache.enabled",
    "response_cache.capacity",
    "response_cache.ttl",
    "response_cache.max_response_size",
    "response_cache.max_stream_buffer_size",
    "response_cache.semantic.enabled",
    "response_cache.semantic.backend",
    "response_cache.semantic.embedding_model",
    "response_cache.semantic.threshold",
    "response_cache.semantic.max_entries",
    "response_cache.semantic.ttl",
    "response_cache.semantic.embedding_timeout_ms",
    "response_cache.semantic.max_input_bytes",
    "control_plane.optimization.semantic_cache_enabled",
    "control_plane.optimization.cache_enabled",
    "control_plane.optimization.exact_cache",
    "control_plane.optimization.semantic_cache",
    "control_plane.optimization.semantic_similarity_bps",
    "control_plane.optimization.cache_ttl_secs",
    # The consumers restart: unchanged sources keep running, changed ones resume from
    # their last event ID when endpoint and transport are the same.
    "kv_cache_index.event_sources[].backend_name",
    "kv_cache_index.event_sources[].endpoint",
    "kv_cache_index.event_sources[].transport",
    "kv_cache_index.event_sources[].reconnect_interval_ms",
    "kv_cache_index.event_sources[].read_timeout_ms",
    # A session whose announced sources are no longer allowed ends with Forbidden.
    "dynamo.event_bus.brokers[].id",
    "dynamo.event_bus.brokers[].role",
    "dynamo.event_bus.brokers[].token_hash",
    "dynamo.event_bus.brokers[].backends",
)
"""Applied by ``Router.apply_config`` (and the reload hooks) at once."""

RESTART_ONLY: tuple[str, ...] = (
    # Listeners, TLS material and the request limits the HTTP server was built with.
    "server.listen",
    "server.grpc_listen",
    "server.grpc_tls_cert",
    "server.grpc_tls_key",
    "server.grpc_tls_client_ca",
    "server.admin_token_file",
    "server.admin_token_env",
    "server.allow_unauthenticated",
    "server.max_body_bytes",
    "server.body_read_timeout_ms",
    "server.max_concurrent_requests",
    "server.connect_timeout_ms",
    "server.request_timeout_ms",
    "server.shutdown_grace_ms",
    # The cache store and the Redis pool it shares with the KV index.
    "response_cache.backend",
    "response_cache.redis.mode",
    "response_cache.redis.url",
    "response_cache.redis.username",
    "response_cache.redis.password",
    "response_cache.redis.tls_ca_file",
    "response_cache.redis.sentinel.master_name",
    "response_cache.redis.sentinel.addresses",
    "response_cache.redis.sentinel.username",
    "response_cache.redis.sentinel.password",
    "response_cache.redis.sentinel.tls",
    "response_cache.redis.sentinel.db",
    "response_cache.redis.cluster.startup_nodes",
    "response_cache.redis.tls",
    "response_cache.redis.pool_size",
    "response_cache.redis.key_prefix",
    "response_cache.redis.connect_timeout_ms",
    "response_cache.redis.command_timeout_ms",
    "response_cache.redis.fallback_capacity",
    "response_cache.redis.fallback_ttl_seconds",
    "response_cache.redis.fallback_to_memory",
    "response_cache.redis.health_check_interval_ms",
    # Tier 4's index, scorers and sweep are built once.
    "kv_cache_index.enabled",
    "kv_cache_index.backend",
    "kv_cache_index.max_entries",
    "kv_cache_index.entry_ttl_seconds",
    "kv_cache_index.cleanup_interval_ms",
    "kv_cache_index.scoring.overlap_weight",
    "kv_cache_index.scoring.load_weight",
    "kv_cache_index.scoring.health_weight",
    "kv_cache_index.scoring.min_overlap_threshold",
    "kv_cache_index.scoring.gpu_tier_weight",
    "kv_cache_index.scoring.storage_tier_weight",
    "kv_cache_index.storage_offloading.enabled",
    "kv_cache_index.storage_offloading.treat_eviction_as_offload",
    "kv_cache_index.salt_secret_file",
    "kv_cache_index.salt_secret_env",
    "kv_cache_index.anti_entropy.interval_seconds",
    "kv_cache_index.anti_entropy.repair",
    "kv_cache_index.anti_entropy.timeout_seconds",
    "kv_cache_index.conversation.enabled",
    "kv_cache_index.conversation.chunk_bytes",
    "kv_cache_index.conversation.templates[].model",
    "kv_cache_index.conversation.templates[].tokenizer_config",
    "kv_cache_index.conversation.templates[].chat_template",
    "kv_cache_index.conversation.templates[].tokenizer",
    "kv_cache_index.conversation.templates[].lora_adapters",
    "kv_cache_index.conversation.max_entries",
    "kv_cache_index.conversation.predict_ttl_seconds",
    "kv_cache_index.conversation.render_cache_bytes",
    "kv_cache_index.conversation.scoring.gpu_credit",
    "kv_cache_index.conversation.scoring.storage_credit",
    "kv_cache_index.conversation.scoring.prefill_load_weight",
    "kv_cache_index.conversation.scoring.active_request_weight",
    "kv_cache_index.conversation.scoring.bytes_per_token",
    "kv_cache_index.conversation.scoring.load_factor_epsilon",
    "kv_cache_index.conversation.scoring.new_prompts",
    "kv_cache_index.conversation.scoring.load_window_seconds",
    "kv_cache_index.conversation.scoring.sticky_tokens",
    "kv_cache_index.conversation.scoring.sticky_load_factor_epsilon",
    "kv_cache_index.conversation.scoring.copy_load_factor_epsilon",
    "kv_cache_index.conversation.scoring.resident_weight",
    "kv_cache_index.conversation.scoring.resident_window_seconds",
    # The event bus server: its socket, TLS and limits.
    "dynamo.event_bus.enabled",
    "dynamo.event_bus.listen",
    "dynamo.event_bus.tls.cert",
    "dynamo.event_bus.tls.key",
    "dynamo.event_bus.tls.client_ca",
    "dynamo.event_bus.max_message_bytes",
    "dynamo.event_bus.max_sessions",
    "dynamo.event_bus.max_streams",
    "dynamo.event_bus.keepalive_time_ms",
    "dynamo.event_bus.keepalive_timeout_ms",
    "dynamo.event_bus.min_client_ping_interval_ms",
    # Its map and background tasks (and the dialect choice made with them).
    "gemini_context_cache.enabled",
    "gemini_context_cache.min_prefix_bytes",
    "gemini_context_cache.ttl",
    "gemini_context_cache.extend_on_hit",
    "gemini_context_cache.max_entries",
    "gemini_context_cache.create_timeout_ms",
    "gemini_context_cache.negative_ttl_seconds",
    "gemini_context_cache.prefer_native_api",
)
"""Kept at their running values by a reload, each change logged as needing a restart."""


def _compared(path: str) -> list[str]:
    """Where a restart-only path is compared: a field inside list items is compared as
    the whole list (``a.b[].c`` → ``a.b``)."""
    head = path.split("[]", 1)[0]
    return head.split(".")


def _values(old: Any, new: Any, parts: list[str]) -> tuple[str, Any, Any]:
    """The path compared and both values; a section that is unset on one side (an
    optional block such as ``response_cache.redis``) is compared whole, at its own path."""
    done: list[str] = []
    for part in parts:
        if old is None or new is None:
            break
        old, new = getattr(old, part), getattr(new, part)
        done.append(part)
    return ".".join(done), old, new


def restart_only_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """YAML paths of restart-only values that differ between two configs, in
    :data:`RESTART_ONLY` order, each once."""
    changed: dict[str, None] = {}
    for path in RESTART_ONLY:
        where, a, b = _values(old, new, _compared(path))
        if a != b:
            changed[where] = None
    return list(changed)


def _with_value(model: Any, parts: list[str], value: Any) -> Any:
    """``model`` with the field at ``parts`` (a nested path) set to ``value``."""
    if len(parts) == 1:
        return model.model_copy(update={parts[0]: value})
    child = getattr(model, parts[0])
    return model.model_copy(update={parts[0]: _with_value(child, parts[1:], value)})


def keep_restart_only(
    old: RouterConfig, new: RouterConfig, changed: Iterable[str] | None = None
) -> RouterConfig:
    """``new`` with every restart-only value put back to its running one."""
    out = new
    for path in restart_only_changes(old, new) if changed is None else changed:
        parts = path.split(".")
        running: Any = old
        for part in parts:
            running = getattr(running, part)
        out = _with_value(out, parts, running)
    return out


def _plain(path: str) -> list[str]:
    return path.replace("[]", "").split(".")


def _under(prefix: list[str], paths: Iterable[str]) -> list[list[str]]:
    n = len(prefix)
    return [p for p in map(_plain, paths) if p[:n] == prefix]


def _group(paths: list[list[str]], other: list[list[str]], depth: int) -> list[str]:
    """The shortest prefixes (longer than ``depth`` parts) covering ``paths`` and none of
    ``other``, in first-seen order, without their first ``depth`` parts."""
    out: dict[str, None] = {}
    for parts in paths:
        for n in range(depth + 1, len(parts) + 1):
            if not any(o[:n] == parts[:n] for o in other):
                out[".".join(parts[depth:n])] = None
                break
    return list(out)


def _describe(prefix: list[str]) -> list[str]:
    """README lines for the section at ``prefix``: one class, or the class that needs the
    fewer exceptions named, with the other's fields as those exceptions."""
    name = ".".join(prefix)
    at_once, restart = _under(prefix, RELOADABLE), _under(prefix, RESTART_ONLY)
    if not restart:
        return [f"- `{name}`: applied at once"]
    if not at_once:
        return [f"- `{name}`: restart-only"]
    children = {p[len(prefix)] for p in at_once + restart}
    if len(children) == 1:
        return _describe([*prefix, *children])
    reloadable = _group(at_once, restart, len(prefix))
    restarting = _group(restart, at_once, len(prefix))
    if len(reloadable) <= len(restarting):
        but = ", ".join(f"`{p}`" for p in reloadable)
        return [f"- `{name}`: restart-only, but {but} applied at once"]
    but = ", ".join(f"`{p}`" for p in restarting)
    return [f"- `{name}`: applied at once, but {but} restart-only"]


def readme_summary() -> str:
    """README's list of what a reload applies and what waits for a restart, one line per
    top-level section (kept equal by a test)."""
    named = {_plain(p)[0] for p in RELOADABLE + RESTART_ONLY}
    sections = [s for s in RouterConfig.model_fields if s in named]
    return "\n".join(line for s in sections for line in _describe([s])) + "\n"
