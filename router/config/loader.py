"""YAML to RouterConfig, with every error and warning named by its YAML path.

``load_config`` is used by ``serve``, by ``config validate`` and by hot reload, so the
three always agree on what a file means.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bus.config import ConfigError, ConfigIssue, parse_validated, read_yaml
from bus.config import log_warnings as _log_warnings

from .models import RouterConfig

__all__ = [
    "RESTART_ONLY",
    "ConfigError",
    "ConfigIssue",
    "check_config",
    "keep_restart_only",
    "load_config",
    "log_warnings",
    "parse_config",
    "restart_only_changes",
]

log = logging.getLogger("continuum.config")

RESTART_ONLY: tuple[str, ...] = (
    "server",
    "kv_cache_index",
    "response_cache.backend",
    "response_cache.redis",
)
"""Sections (or single fields) a reload cannot apply: they own sockets, pools, tasks."""
"""Top-level sections a reload cannot apply (they own sockets and credentials)."""


def check_config(cfg: RouterConfig) -> list[ConfigIssue]:
    """Cross-field rules: errors the field types cannot express, and warnings."""
    issues: list[ConfigIssue] = []
    seen: dict[str, int] = {}
    for i, b in enumerate(cfg.backends):
        if b.name in seen:
            issues.append(
                ConfigIssue(
                    "error",
                    f"backends[{i}].name",
                    f"duplicate backend name {b.name!r} (first at backends[{seen[b.name]}])",
                )
            )
        else:
            seen[b.name] = i
    if cfg.server.admin_token_file and not Path(cfg.server.admin_token_file).is_file():
        issues.append(
            ConfigIssue(
                "error",
                "server.admin_token_file",
                f"file {cfg.server.admin_token_file!r} does not exist",
            )
        )
    srv = cfg.server
    if bool(srv.grpc_tls_cert) != bool(srv.grpc_tls_key):
        issues.append(
            ConfigIssue(
                "error", "server.grpc_tls_key", "grpc_tls_cert and grpc_tls_key go together"
            )
        )
    for field in ("grpc_tls_cert", "grpc_tls_key"):
        value = getattr(srv, field)
        if value and not Path(value).is_file():
            issues.append(ConfigIssue("error", f"server.{field}", f"file {value!r} does not exist"))
    if cfg.selection_strategy == "PrefixAwareHash" and not cfg.prefix_routing.enabled:
        issues.append(
            ConfigIssue(
                "warning",
                "selection_strategy",
                "PrefixAwareHash with prefix_routing.enabled: false hashes only the model "
                "name, so every request for a model goes to one backend; set "
                "prefix_routing.enabled: true",
            )
        )
    kv = cfg.kv_cache_index
    sc = kv.scoring
    total = sc.overlap_weight + sc.load_weight + sc.health_weight
    if abs(total - 1.0) > 1e-6:
        issues.append(
            ConfigIssue(
                "error",
                "kv_cache_index.scoring",
                f"overlap_weight + load_weight + health_weight must sum to 1.0 (got {total:g})",
            )
        )
    if kv.enabled and cfg.prefix_routing.enabled and sc.gpu_tier_weight < sc.min_overlap_threshold:
        issues.append(
            ConfigIssue(
                "warning",
                "kv_cache_index.scoring.gpu_tier_weight",
                f"{sc.gpu_tier_weight:g} is below min_overlap_threshold "
                f"{sc.min_overlap_threshold:g}: no backend can pass, every request falls back "
                "to selection_strategy",
            )
        )
    if kv.enabled and not cfg.prefix_routing.enabled:
        issues.append(
            ConfigIssue(
                "warning",
                "kv_cache_index.enabled",
                "the KV index needs prefix keys: set prefix_routing.enabled: true",
            )
        )
    if cfg.response_cache.backend == "redis" and cfg.response_cache.redis is None:
        issues.append(
            ConfigIssue(
                "error", "response_cache.redis", "backend redis requires response_cache.redis"
            )
        )
    if kv.backend == "redis" and cfg.response_cache.redis is None:
        issues.append(
            ConfigIssue(
                "error",
                "kv_cache_index.backend",
                "redis requires response_cache.redis (the shared connection pool)",
            )
        )
    for i, b in enumerate(cfg.backends):
        if b.cache_salt and b.type not in ("vllm", "sglang", "trtllm"):
            issues.append(
                ConfigIssue(
                    "error",
                    f"backends[{i}].cache_salt",
                    f"cache salts are for vllm, sglang and trtllm backends, not {b.type}",
                )
            )
        if (b.cache_salt or b.type == "trtllm") and not (kv.salt_secret_file or kv.salt_secret_env):
            if b.cache_salt:
                issues.append(
                    ConfigIssue(
                        "error",
                        f"backends[{i}].cache_salt",
                        "requires kv_cache_index.salt_secret_file or salt_secret_env",
                    )
                )
    if kv.salt_secret_file and not Path(kv.salt_secret_file).is_file():
        issues.append(
            ConfigIssue(
                "error",
                "kv_cache_index.salt_secret_file",
                f"file {kv.salt_secret_file!r} does not exist",
            )
        )
    names = {b.name for b in cfg.backends}
    seen_sources: set[str] = set()
    for i, src in enumerate(kv.event_sources):
        path = f"kv_cache_index.event_sources[{i}]"
        if src.backend_name not in names:
            issues.append(
                ConfigIssue(
                    "error", f"{path}.backend_name", f"no backend named {src.backend_name!r}"
                )
            )
        if src.backend_name in seen_sources:
            issues.append(ConfigIssue("error", f"{path}.backend_name", "duplicate event source"))
        seen_sources.add(src.backend_name)
        if src.transport == "sse" and src.endpoint is None:
            issues.append(
                ConfigIssue("error", f"{path}.endpoint", "transport sse requires endpoint")
            )
        if src.transport == "event_bus":
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.transport",
                    "event_bus (push mode) is not implemented in this version; use sse",
                )
            )
    if not any(b.enabled and not b.internal for b in cfg.backends):
        issues.append(
            ConfigIssue("warning", "backends", "no enabled backend: every request will get 503")
        )
    return issues


def parse_config(data: Any, source: str = "<config>") -> tuple[RouterConfig, list[ConfigIssue]]:
    """Validate already-parsed YAML. Raises ConfigError; returns the config and warnings."""
    return parse_validated(RouterConfig, data, source, check_config)


def load_config(path: str | Path) -> tuple[RouterConfig, list[ConfigIssue]]:
    """Read and validate a YAML file. Raises ConfigError naming the path of each problem."""
    return parse_config(read_yaml(path), str(path))


def log_warnings(issues: Iterable[ConfigIssue]) -> None:
    _log_warnings(issues, log)


def restart_only_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """YAML paths of restart-only fields that differ between two configs."""
    changed: list[str] = []
    for path in RESTART_ONLY:
        section, _, field = path.partition(".")
        a = getattr(old, section).model_dump()
        b = getattr(new, section).model_dump()
        if field:
            if a.get(field) != b.get(field):
                changed.append(path)
        else:
            changed.extend(f"{section}.{k}" for k in a if a[k] != b.get(k))
    return changed


def keep_restart_only(old: RouterConfig, new: RouterConfig) -> RouterConfig:
    """``new`` with every restart-only field put back to its running value."""
    update: dict[str, Any] = {}
    for path in RESTART_ONLY:
        section, _, field = path.partition(".")
        if field:
            current = update.get(section, getattr(new, section))
            update[section] = current.model_copy(
                update={field: getattr(getattr(old, section), field)}
            )
        else:
            update[section] = getattr(old, section)
    return new.model_copy(update=update)
