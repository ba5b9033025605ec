"""YAML to RouterConfig, with every error and warning named by its YAML path.

``load_config`` is used by ``serve``, by ``config validate`` and by hot reload, so the
three always agree on what a file means.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bus.config import ConfigError, ConfigIssue, duplicate_names, parse_validated, read_yaml
from bus.config import log_warnings as _log_warnings

from ..conversation import TemplateLoadError, load_chat_template
from .admin_token import read_admin_token
from .models import RouterConfig, ServerConfig, parse_hostport

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "check_config",
    "load_config",
    "log_warnings",
    "parse_config",
]

log = logging.getLogger("continuum.config")


def check_config(cfg: RouterConfig) -> list[ConfigIssue]:
    """Cross-field rules: errors the field types cannot express, and warnings."""
    issues = duplicate_names([b.name for b in cfg.backends], "backends", "name", "backend name")
    issues.extend(_server_issues(cfg.server))
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
                "the KV index is fed but not consulted without prefix keys: set "
                "prefix_routing.enabled: true (it hot-reloads)",
            )
        )
    if cfg.response_cache.backend == "redis" and cfg.response_cache.redis is None:
        issues.append(
            ConfigIssue(
                "error", "response_cache.redis", "backend redis requires response_cache.redis"
            )
        )
    issues.extend(_semantic_cache_issues(cfg))
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
        if src.transport == "event_bus" and src.endpoint is not None:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.endpoint",
                    "transport event_bus takes no endpoint (the listener dials the router)",
                )
            )
        if src.transport == "event_bus" and not cfg.dynamo.event_bus.enabled:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.transport",
                    "transport event_bus requires dynamo.event_bus.enabled: true",
                )
            )
    issues.extend(_event_bus_issues(cfg))
    issues.extend(_conversation_issues(cfg))
    if not any(b.enabled and not b.internal for b in cfg.backends):
        issues.append(
            ConfigIssue("warning", "backends", "no enabled backend: every request will get 503")
        )
    return issues


_EMBEDDING_TYPES = ("openai", "vllm", "sglang", "gemini")


def _is_loopback(listen: str) -> bool:
    host = parse_hostport(listen)[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _server_issues(srv: ServerConfig) -> list[ConfigIssue]:
    """TLS files, the token source, and who can reach the admin surface without a token."""
    issues: list[ConfigIssue] = []
    if bool(srv.grpc_tls_cert) != bool(srv.grpc_tls_key):
        issues.append(
            ConfigIssue(
                "error", "server.grpc_tls_key", "grpc_tls_cert and grpc_tls_key go together"
            )
        )
    if srv.grpc_tls_client_ca and not (srv.grpc_tls_cert and srv.grpc_tls_key):
        issues.append(
            ConfigIssue(
                "error",
                "server.grpc_tls_client_ca",
                "client certificates (mTLS) need grpc_tls_cert and grpc_tls_key",
            )
        )
    for field in ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_client_ca"):
        value = getattr(srv, field)
        if value and not Path(value).is_file():
            issues.append(ConfigIssue("error", f"server.{field}", f"file {value!r} does not exist"))
    try:
        token = read_admin_token(srv)
    except ConfigError as exc:
        return [*issues, *exc.issues]
    if token is not None:
        if srv.grpc_listen and not _is_loopback(srv.grpc_listen) and not srv.grpc_tls_cert:
            issues.append(
                ConfigIssue(
                    "warning",
                    "server.grpc_listen",
                    f"{srv.grpc_listen} is not loopback and gRPC runs without TLS: the admin "
                    "token travels in plaintext; set grpc_tls_cert and grpc_tls_key",
                )
            )
        return issues
    exposed: list[tuple[str, str, str]] = []
    if not _is_loopback(srv.listen):
        exposed.append(("listen", srv.listen, "/admin/*"))
    if srv.grpc_listen and not _is_loopback(srv.grpc_listen) and not srv.grpc_tls_client_ca:
        exposed.append(
            ("grpc_listen", srv.grpc_listen, "KvIndex (Query, Score, Backends, Stats, Clear)")
        )
    if srv.allow_unauthenticated:
        if exposed:
            issues.append(
                ConfigIssue(
                    "warning",
                    "server.allow_unauthenticated",
                    "no admin token: "
                    + " and ".join(f"{what} on {addr}" for _, addr, what in exposed)
                    + " answer anyone who can connect; only for a trusted network",
                )
            )
        return issues
    for field, addr, what in exposed:
        fix = "server.admin_token_file or server.admin_token_env"
        if field == "grpc_listen":
            fix += ", server.grpc_tls_client_ca (mTLS)"
        issues.append(
            ConfigIssue(
                "error",
                f"server.{field}",
                f"{addr} is not a loopback address and no admin token is configured: {what} "
                f"would be open to anyone who can connect; set {fix}, or "
                "server.allow_unauthenticated: true on a trusted network",
            )
        )
    return issues


def _semantic_cache_issues(cfg: RouterConfig) -> list[ConfigIssue]:
    """``response_cache.semantic``: required fields, and a backend that may embed."""
    sem = cfg.response_cache.semantic
    path = "response_cache.semantic"
    issues: list[ConfigIssue] = []
    if sem.enabled:
        for field in ("backend", "embedding_model"):
            if not getattr(sem, field):
                issues.append(
                    ConfigIssue(
                        "error", f"{path}.{field}", f"semantic.enabled requires {path}.{field}"
                    )
                )
    if sem.backend:
        target = next((b for b in cfg.backends if b.name == sem.backend), None)
        if target is None:
            issues.append(
                ConfigIssue(
                    "error", f"{path}.backend", f"no backend named {sem.backend!r} in backends"
                )
            )
        elif sem.enabled and not target.enabled:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.backend",
                    f"backend {sem.backend!r} has enabled: false; the embeddings backend must "
                    "be enabled (internal: true is allowed)",
                )
            )
        elif sem.enabled and target.type not in _EMBEDDING_TYPES:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.backend",
                    f"backend {sem.backend!r} is of type {target.type}, which serves no "
                    f"/v1/embeddings (use one of {', '.join(_EMBEDDING_TYPES)})",
                )
            )
    if sem.enabled and not cfg.response_cache.enabled:
        issues.append(
            ConfigIssue(
                "warning",
                f"{path}.enabled",
                "the semantic cache requires response_cache.enabled: true; it stays off",
            )
        )
    elif sem.enabled and not cfg.control_plane.optimization.semantic_cache_enabled:
        issues.append(
            ConfigIssue(
                "warning",
                f"{path}.enabled",
                "the semantic cache serves only with "
                "control_plane.optimization.semantic_cache_enabled: true",
            )
        )
    return issues


def _event_bus_issues(cfg: RouterConfig) -> list[ConfigIssue]:
    """``dynamo.event_bus``: TLS material, unique broker ids, a way to authenticate."""
    bus = cfg.dynamo.event_bus
    path = "dynamo.event_bus"
    issues: list[ConfigIssue] = []
    if not bus.enabled:
        return issues
    for field in ("cert", "key"):
        value = getattr(bus.tls, field)
        if not value:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.tls.{field}",
                    "the event bus is TLS only: tls.cert and tls.key are required",
                )
            )
    for field in ("cert", "key", "client_ca"):
        value = getattr(bus.tls, field)
        if value and not Path(value).is_file():
            issues.append(
                ConfigIssue("error", f"{path}.tls.{field}", f"file {value!r} does not exist")
            )
    seen: dict[str, int] = {}
    for i, b in enumerate(bus.brokers):
        if b.id in seen:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.brokers[{i}].id",
                    f"duplicate broker id {b.id!r} (first at brokers[{seen[b.id]}])",
                )
            )
        else:
            seen[b.id] = i
        if b.token_hash is None and not bus.tls.client_ca:
            issues.append(
                ConfigIssue(
                    "error",
                    f"{path}.brokers[{i}].token_hash",
                    "no way to authenticate this entry: set token_hash, or tls.client_ca for "
                    "client certificates",
                )
            )
    announced = {s for b in bus.brokers if b.role == "kv_listener" for s in b.backends}
    for i, src in enumerate(cfg.kv_cache_index.event_sources):
        if src.transport == "event_bus" and src.backend_name not in announced:
            issues.append(
                ConfigIssue(
                    "warning",
                    f"kv_cache_index.event_sources[{i}].backend_name",
                    f"no kv_listener broker entry lists {src.backend_name!r} in its backends: "
                    "no listener may announce it",
                )
            )
    return issues


_ENGINE_TYPES = ("vllm", "sglang", "trtllm")


def _conversation_issues(cfg: RouterConfig) -> list[ConfigIssue]:
    """``kv_cache_index.conversation``: every template file loads (checked whether or not
    the mode is on, so turning it on cannot fail at start); served names are unique; with
    the mode on, an engine backend's model without a template is routed on prefix keys
    only (a warning)."""
    conv = cfg.kv_cache_index.conversation
    path = "kv_cache_index.conversation"
    issues: list[ConfigIssue] = []
    served: dict[str, str] = {}
    for i, spec in enumerate(conv.templates):
        where = f"{path}.templates[{i}]"
        try:
            load_chat_template(spec.tokenizer_config, spec.chat_template, spec.tokenizer)
        except TemplateLoadError as exc:
            issues.append(ConfigIssue("error", f"{where}.{exc.field}", exc.message))
        for j, name in enumerate([spec.model, *spec.lora_adapters]):
            field = f"{where}.model" if j == 0 else f"{where}.lora_adapters[{j - 1}]"
            if name in served:
                issues.append(
                    ConfigIssue("error", field, f"{name!r} already has a template ({served[name]})")
                )
            else:
                served[name] = field
        if conv.enabled and spec.tokenizer is None:
            issues.append(
                ConfigIssue(
                    "warning",
                    f"{where}.tokenizer",
                    "no tokenizer.json: its normalizer is not applied, so prompts the "
                    "engine's tokenizer would normalize (Qwen's: NFC) get keys no backend holds",
                )
            )
    if not conv.enabled:
        return issues
    if not conv.templates:
        issues.append(
            ConfigIssue(
                "warning",
                f"{path}.templates",
                "conversation mode is on but no model has a template: every request is "
                "routed on its prefix key",
            )
        )
    for i, b in enumerate(cfg.backends):
        if not b.enabled or b.internal or b.type not in _ENGINE_TYPES:
            continue
        for j, model in enumerate(b.models):
            if model not in served:
                issues.append(
                    ConfigIssue(
                        "warning",
                        f"backends[{i}].models[{j}]",
                        f"{path} is on but {model!r} has no chat template in "
                        f"{path}.templates: its requests are routed on the prefix key only",
                    )
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
