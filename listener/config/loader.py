"""YAML to ``ListenerConfig`` (``models``), with every rule between fields.

Every error and warning names its YAML path (``sources[1].zmq_endpoint``), including the
cross-field rules that field types cannot express (``check_listener_config``):

* ``engine: vllm|sglang`` requires ``zmq_endpoint``; ``engine: trtllm`` requires
  ``trtllm_endpoint`` and forbids every ``zmq_*`` option (and ``topic``,
  ``replay_endpoint``, ``dp_ranks``); ``poll_interval_ms`` belongs to trtllm only.
* ``detokenize_endpoint`` requires ``model`` (the model name is part of the prefix key).
* A chain is attributed to a prefix key through ``detokenize_endpoint`` or through a
  router-issued cache salt (``salt_secret_file`` / ``salt_secret_env``). A ZMQ source with
  neither gets a warning (its events can never be published); ``engine: trtllm``
  *requires* a salt secret, because trtllm-serve has no public ``/detokenize``.
* The host of ``trtllm_endpoint`` must be listed in ``allowed_publishers``.
* ``conversation.enabled`` requires every source's ``tokenizer``, a file of a kind whose
  tokens spell the text (``listener.token_bytes``: loaded here, so ``--check`` refuses what
  the process would); a source without ``model`` then gets a warning (its chains have no
  root), and a ``tokenizer`` with conversation mode off gets one too (unused).
* ``backend_name`` is unique; ZMQ endpoints the listener binds are unique after the
  ``dp_ranks`` expansion (``tcp://h:5557`` -> ``tcp://h:5557+rank``).
* ``event_bus`` (push mode, ``listener.push.config``): https URL, a credential from a file
  or an environment variable (never inline) or an mTLS client certificate, existing files.

``load_listener_config`` is what ``continuum-kv-listener --check`` and the process itself
use, so the two always agree on what a file means.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from bus.config import (
    ConfigIssue,
    clean_message,
    duplicate_names,
    parse_hostport,
    parse_validated,
    read_yaml,
    yaml_path,
)
from bus.config import log_warnings as _log_warnings
from listener.endpoints import offset_endpoint
from listener.token_bytes import TokenizerFileError, load_token_bytes

from .models import (
    _TRTLLM_ONLY,
    _ZMQ_ONLY,
    _ZMQ_TCP_RE,
    ListenerConfig,
    SourceConfig,
)

__all__ = ["check_listener_config", "load_listener_config", "log_warnings", "parse_listener_config"]

log = logging.getLogger("continuum.listener.config")


def _validation_issues(exc: ValidationError) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    seen: set[str] = set()
    for e in exc.errors(include_url=False):
        loc = tuple(e["loc"])
        path = yaml_path(loc)
        literal_branch = any(isinstance(p, str) and p.startswith("literal[") for p in loc)
        markers_branch = "ChatTemplateMarkers" in loc
        if literal_branch and isinstance(e.get("input"), dict):
            continue  # the marker mapping's own errors say more
        if literal_branch or (markers_branch and e["type"] == "model_type"):
            message = 'must be "chatml", "llama3" or a mapping {system_start, user_start, end}'
        elif e["type"] == "extra_forbidden":
            message = "unknown field"
        else:
            message = clean_message(e["msg"])
        key = f"{path}\0{message}"
        if key not in seen:
            seen.add(key)
            issues.append(ConfigIssue("error", path, message))
    return issues


def _check_source(cfg: ListenerConfig, i: int, s: SourceConfig) -> list[ConfigIssue]:
    p = f"sources[{i}]"
    issues: list[ConfigIssue] = []
    given = s.model_fields_set

    def err(field: str, message: str) -> None:
        issues.append(ConfigIssue("error", f"{p}.{field}", message))

    if s.engine == "trtllm":
        if s.trtllm_endpoint is None:
            err("trtllm_endpoint", f"engine trtllm requires {p}.trtllm_endpoint")
        for field in _ZMQ_ONLY:
            if field in given:
                err(field, f"engine trtllm does not use ZMQ: remove {p}.{field}")
        if not cfg.has_salt_secret:
            err(
                "engine",
                "engine trtllm requires salt_secret_file or salt_secret_env: trtllm-serve has "
                "no public /detokenize, so prefix keys come only from router-issued cache salts",
            )
        if s.trtllm_endpoint is not None:
            host = urlsplit(s.trtllm_endpoint).hostname or ""
            if not s.allowed_publishers or not s.publisher_allowed(host):
                err(
                    "allowed_publishers",
                    f"trtllm_endpoint host {host!r} must be listed in {p}.allowed_publishers",
                )
    else:
        if s.zmq_endpoint is None:
            err("zmq_endpoint", f"engine {s.engine} requires {p}.zmq_endpoint")
        for field in _TRTLLM_ONLY:
            if field in given:
                err(field, f"{p}.{field} is for engine trtllm only (this source is {s.engine})")
        if s.zmq_endpoint is not None and s.dp_ranks and s.dp_ranks > 1:
            for field, value in (
                ("zmq_endpoint", s.zmq_endpoint),
                ("replay_endpoint", s.replay_endpoint),
            ):
                if value is None:
                    continue
                try:
                    offset_endpoint(value, s.dp_ranks - 1)
                except ValueError as exc:
                    err(field, f"{p}.dp_ranks requires a tcp:// or inproc:// endpoint: {exc}")
                    continue
                m = _ZMQ_TCP_RE.match(value)
                if m and int(m.group("port")) + s.dp_ranks - 1 > 65535:
                    err(field, f"port + dp_ranks - 1 exceeds 65535 ({value!r}, {s.dp_ranks})")
        if s.zmq_endpoint is not None and s.replay_endpoint is not None and not issues:
            eps = s.zmq_endpoints()
            live = {ep.endpoint: ep.rank for ep in eps}
            for ep in eps:
                if ep.replay_endpoint in live:
                    err(
                        "replay_endpoint",
                        f"replay endpoint {ep.replay_endpoint} of dp rank {ep.rank} is also "
                        f"the zmq_endpoint of dp rank {live[ep.replay_endpoint]}",
                    )
                    break
        if s.zmq_mode == "bind" and not s.allowed_publishers:
            issues.append(
                ConfigIssue(
                    "warning",
                    f"{p}.allowed_publishers",
                    "zmq_mode bind with no allowed_publishers accepts events from any peer "
                    "that can reach the port; list the engines' addresses",
                )
            )
        if s.detokenize_endpoint is None and not cfg.has_salt_secret:
            issues.append(
                ConfigIssue(
                    "warning",
                    p,
                    "no way to attribute chains to prefix keys: set "
                    f"{p}.detokenize_endpoint or salt_secret_file/salt_secret_env; "
                    "until then this backend publishes no cache events",
                )
            )
    if s.detokenize_endpoint is not None and s.model is None:
        err("model", f"{p}.detokenize_endpoint requires {p}.model (it is part of the prefix key)")
    if cfg.conversation.enabled:
        if s.tokenizer is None:
            err("tokenizer", f"conversation.enabled requires {p}.tokenizer (a tokenizer.json)")
        else:
            try:
                load_token_bytes(s.tokenizer)
            except TokenizerFileError as exc:
                err("tokenizer", str(exc))
        if s.model is None:
            issues.append(
                ConfigIssue(
                    "warning",
                    f"{p}.model",
                    "conversation keys are rooted at the served model name: without "
                    f"{p}.model this source announces none",
                )
            )
    elif s.tokenizer is not None:
        issues.append(
            ConfigIssue("warning", f"{p}.tokenizer", "unused: conversation.enabled is false")
        )
    if s.max_chain_tokens > s.max_retained_tokens:
        issues.append(
            ConfigIssue(
                "warning",
                f"{p}.max_chain_tokens",
                f"larger than {p}.max_retained_tokens: no full chain can be retained",
            )
        )
    return issues


def check_listener_config(cfg: ListenerConfig) -> list[ConfigIssue]:
    """Cross-field rules: errors the field types cannot express, and warnings."""
    issues: list[ConfigIssue] = []
    if cfg.event_bus is not None:
        for path, message in cfg.event_bus.issues("event_bus"):
            issues.append(ConfigIssue("error", path, message))
    if cfg.grpc_tls is not None and cfg.grpc_listen is None:
        issues.append(ConfigIssue("error", "grpc_tls", "grpc_tls requires grpc_listen"))
    if cfg.grpc_tls is not None:
        for field in ("cert", "key", "client_ca"):
            value = getattr(cfg.grpc_tls, field)
            if value is not None and not Path(value).is_file():
                issues.append(
                    ConfigIssue("error", f"grpc_tls.{field}", f"file {value!r} does not exist")
                )
    if cfg.session_predictor is not None:
        if not cfg.eviction_advisor or cfg.grpc_listen is None:
            issues.append(
                ConfigIssue(
                    "error",
                    "session_predictor",
                    "session_predictor requires eviction_advisor and grpc_listen",
                )
            )
        if not Path(cfg.session_predictor).is_file():
            issues.append(
                ConfigIssue(
                    "error",
                    "session_predictor",
                    f"file {cfg.session_predictor!r} does not exist",
                )
            )
    if cfg.salt_secret_file is not None and not Path(cfg.salt_secret_file).is_file():
        issues.append(
            ConfigIssue(
                "error", "salt_secret_file", f"file {cfg.salt_secret_file!r} does not exist"
            )
        )
    if cfg.grpc_listen is not None:
        h1, p1 = parse_hostport(cfg.listen)
        h2, p2 = parse_hostport(cfg.grpc_listen)
        if p1 and p1 == p2 and (h1 == h2 or "0.0.0.0" in (h1, h2) or "::" in (h1, h2)):
            issues.append(
                ConfigIssue("error", "grpc_listen", f"port {p2} is already used by listen")
            )
    if not cfg.sources:
        issues.append(
            ConfigIssue("warning", "sources", "no sources: every /events/{backend} is a 404")
        )
    names = [s.backend_name for s in cfg.sources]
    issues += duplicate_names(names, "sources", "backend_name", "backend_name")
    bound: dict[str, str] = {}
    for i, s in enumerate(cfg.sources):
        source_issues = _check_source(cfg, i, s)
        issues.extend(source_issues)
        if (
            s.zmq_mode == "bind"
            and s.zmq_endpoint is not None
            and not any(x.severity == "error" for x in source_issues)
        ):
            for ep in s.zmq_endpoints():
                if ep.endpoint in bound:
                    issues.append(
                        ConfigIssue(
                            "error",
                            f"sources[{i}].zmq_endpoint",
                            f"{ep.endpoint} is already bound by {bound[ep.endpoint]}",
                        )
                    )
                else:
                    bound[ep.endpoint] = f"sources[{i}].zmq_endpoint"
    return issues


def parse_listener_config(
    data: Any, source: str = "<config>"
) -> tuple[ListenerConfig, list[ConfigIssue]]:
    """Validate already-parsed YAML. Raises ConfigError; returns the config and warnings."""
    return parse_validated(ListenerConfig, data, source, check_listener_config, _validation_issues)


def load_listener_config(path: str | Path) -> tuple[ListenerConfig, list[ConfigIssue]]:
    """Read and validate a YAML file.

    Returns:
        The config and the warnings (each naming its YAML path).

    Raises:
        ConfigError: the file is unreadable, not YAML, or invalid; ``issues`` names the
            YAML path of every error.
    """
    data = read_yaml(path)
    return parse_listener_config(data, str(path))


def log_warnings(issues: Iterable[ConfigIssue]) -> None:
    _log_warnings(issues, log)
