"""Router configuration: typed models and the YAML loader."""

from .loader import (
    RESTART_ONLY,
    ConfigError,
    ConfigIssue,
    check_config,
    load_config,
    log_warnings,
    parse_config,
    restart_only_changes,
)
from .models import (
    BACKEND_TYPES,
    STRATEGIES,
    BackendConfig,
    HealthCheckConfig,
    PrefixRoutingConfig,
    RouterConfig,
    ServerConfig,
    parse_hostport,
)

__all__ = [
    "BACKEND_TYPES",
    "RESTART_ONLY",
    "STRATEGIES",
    "BackendConfig",
    "ConfigError",
    "ConfigIssue",
    "HealthCheckConfig",
    "PrefixRoutingConfig",
    "RouterConfig",
    "ServerConfig",
    "check_config",
    "load_config",
    "log_warnings",
    "parse_config",
    "parse_hostport",
    "restart_only_changes",
]
