"""Backend selection: strategies, the CHWBL ring and the selector that runs them."""

from .ring import HashRing, key_position
from .selector import BackendScorer, RoutingCounts, Selector
from .strategies import STRATEGY_CLASSES, SelectionContext, Strategy

__all__ = [
    "STRATEGY_CLASSES",
    "BackendScorer",
    "HashRing",
    "RoutingCounts",
    "SelectionContext",
    "Selector",
    "Strategy",
    "key_position",
]
