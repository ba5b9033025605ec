"""Multi-turn session predictor: at a session's first request, will it continue?

A 3-layer MLP (``input -> 256 -> 256 -> 1``, ReLU, sigmoid output: the probability that
the session sends another request). Its input is the serving model's final hidden state
when an engine supplies one (any width; the model file records it), otherwise the cheap
local text feature vector of :func:`text_features` (``FEATURES`` = 72 values):

* 8 numeric features: log1p of the system prompt's and the last user message's lengths
  in characters, the number of messages, whether tools are declared, whether the user
  text contains code (a fence or ``def``/``class``/``{``), a question mark, a URL, and
  whether it is shorter than 80 characters;
* 64 hashed bag-of-words counts of the user text's lowercased words (crc32 mod 64),
  normalised to unit length.

The prediction routes the session's first blocks: continuing sessions to the chat queue
(agent when tools are declared), others as single-turn (evict-first, or structure once a
block is seen shared). Without torch or without a model file the caller keeps the
rule-based default (``SessionClass.UNKNOWN``, routed like chat).

torch is imported only inside the functions that need it, so the listener runs without
it. Model files are ``torch.save`` dicts: ``{"input_dim", "hidden", "state_dict",
"threshold", "features"}``, a few hundred KB.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .types import SessionClass

__all__ = [
    "FEATURES",
    "HIDDEN",
    "Predictor",
    "build_mlp",
    "load_predictor",
    "text_features",
]

FEATURES = 72
HIDDEN = 256
_BUCKETS = 64
_WORD = re.compile(r"[a-z0-9_]+")
_CODE = re.compile(r"```|\bdef |\bclass |[{};]\s*$", re.M)


def text_features(system: str, user: str, n_messages: int, tools: bool) -> list[float]:
    """The 72-value feature vector of a first request (see the module docstring)."""
    low = user.lower()
    bag = [0.0] * _BUCKETS
    for w in _WORD.findall(low[:8000]):
        bag[zlib.crc32(w.encode()) % _BUCKETS] += 1.0
    norm = math.sqrt(sum(x * x for x in bag)) or 1.0
    numeric = [
        math.log1p(len(system)) / 10,
        math.log1p(len(user)) / 10,
        math.log1p(n_messages) / 3,
        1.0 if tools else 0.0,
        1.0 if _CODE.search(user) else 0.0,
        1.0 if "?" in user else 0.0,
        1.0 if "http://" in low or "https://" in low else 0.0,
        1.0 if len(user) < 80 else 0.0,
    ]
    return numeric + [x / norm for x in bag]


def build_mlp(input_dim: int, hidden: int = HIDDEN) -> Any:
    """The 3-layer MLP (a ``torch.nn.Sequential``); needs torch."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(input_dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


class Predictor:
    """A loaded model: ``probability(features)`` and ``classify(...)``."""

    def __init__(self, model: Any, input_dim: int, threshold: float = 0.5) -> None:
        self.model = model
        self.input_dim = input_dim
        self.threshold = threshold

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def probabilities(self, rows: Sequence[Sequence[float]]) -> list[float]:
        import torch

        if any(len(r) != self.input_dim for r in rows):
            raise ValueError(f"feature vectors must have {self.input_dim} values")
        with torch.inference_mode():
            x = torch.tensor(rows, dtype=torch.float32)
            return torch.sigmoid(self.model(x)).squeeze(-1).tolist()

    def classify(self, features: Sequence[float], tools: bool = False) -> SessionClass:
        p = self.probabilities([features])[0]
        if p < self.threshold:
            return SessionClass.SINGLE
        return SessionClass.AGENT if tools else SessionClass.CHAT

    def for_trace(self) -> Callable[[Any], SessionClass]:
        """A ``bench.saecache`` predictor hook: classifies a request by its features."""

        def predict(req: Any) -> SessionClass:
            if not req.text_features:
                return SessionClass.UNKNOWN
            return self.classify(req.text_features, req.tools)

        return predict


def load_predictor(path: str | Path) -> Predictor:
    """Load a model file written by ``python -m listener.saecache.train``.

    Raises:
        ImportError: torch is not installed.
        ValueError: the file is not a predictor model.
    """
    import torch

    blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or "state_dict" not in blob or "input_dim" not in blob:
        raise ValueError(f"{path}: not a session predictor model file")
    model = build_mlp(int(blob["input_dim"]), int(blob.get("hidden", HIDDEN)))
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return Predictor(model, int(blob["input_dim"]), float(blob.get("threshold", 0.5)))
