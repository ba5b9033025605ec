"""SAECache: semantic-adaptive eviction for prefix caches (see ``policy`` for the algorithm).

Importing this package never imports torch; the session predictor loads it lazily.
"""

from .policy import SaeCache, SaeConfig, SaeParams, offset_bucket
from .types import Queue, SessionClass, TokenType, route

__all__ = [
    "Queue",
    "SaeCache",
    "SaeConfig",
    "SaeParams",
    "SessionClass",
    "TokenType",
    "offset_bucket",
    "route",
]
