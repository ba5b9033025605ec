"""Configuration of ``continuum-kv-listener``: typed models (``models``) and the loader
with its cross-field rules (``loader``), which ``--check`` and the process both use."""

from bus.config import ConfigError, ConfigIssue, parse_hostport

from .loader import check_listener_config, load_listener_config, log_warnings, parse_listener_config
from .models import (
    BACKEND_NAME_RE,
    ENGINES,
    ChatTemplateMarkers,
    ConversationConfig,
    GrpcTlsConfig,
    ListenerConfig,
    SourceConfig,
    ZmqEndpoint,
)

__all__ = [
    "BACKEND_NAME_RE",
    "ENGINES",
    "ChatTemplateMarkers",
    "ConfigError",
    "ConfigIssue",
    "ConversationConfig",
    "GrpcTlsConfig",
    "ListenerConfig",
    "SourceConfig",
    "ZmqEndpoint",
    "check_listener_config",
    "load_listener_config",
    "log_warnings",
    "parse_hostport",
    "parse_listener_config",
]
