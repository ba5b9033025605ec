"""YAML to RouterConfig, with every error and warning named by its YAML path.

``load_config`` is used by ``serve``, by ``config validate`` and by hot reload, so the
three always agree on what a file means.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bus.config import ConfigError, ConfigIssue, read_yaml, validation_issues
from bus.config import log_warnings as _log_warnings

from .models import RouterConfig

__all__ = [
    "RESTART_ONLY",
    "ConfigError",
    "ConfigIssue",
    "check_config",
    "load_config",
    "log_warnings",
    "parse_config",
    "restart_only_changes",
]

log = logging.getLogger("continuum.config")

RESTART_ONLY: tuple[str, ...] = ("server",)
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
    if not any(b.enabled and not b.internal for b in cfg.backends):
        issues.append(
            ConfigIssue("warning", "backends", "no enabled backend: every request will get 503")
        )
    return issues


def parse_config(data: Any, source: str = "<config>") -> tuple[RouterConfig, list[ConfigIssue]]:
    """Validate already-parsed YAML. Raises ConfigError; returns the config and warnings."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [ConfigIssue("error", "(root)", f"{source}: expected a mapping at the top level")]
        )
    try:
        cfg = RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_issues(exc)) from None
    issues = check_config(cfg)
    errors = [i for i in issues if i.severity == "error"]
    if errors:
        raise ConfigError(errors)
    return cfg, issues


def load_config(path: str | Path) -> tuple[RouterConfig, list[ConfigIssue]]:
    """Read and validate a YAML file. Raises ConfigError naming the path of each problem."""
    return parse_config(read_yaml(path), str(path))


def log_warnings(issues: Iterable[ConfigIssue]) -> None:
    _log_warnings(issues, log)


def restart_only_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """YAML paths of restart-only fields that differ between two configs."""
    changed: list[str] = []
    for section in RESTART_ONLY:
        a = getattr(old, section).model_dump()
        b = getattr(new, section).model_dump()
        changed.extend(f"{section}.{k}" for k in a if a[k] != b.get(k))
    return changed
