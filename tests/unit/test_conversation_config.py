"""``kv_cache_index.conversation`` in ``check_config``: a template file that does not load
is an error naming its YAML path; with the mode on, an engine's model without a template
is a warning ``config validate`` prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from router.config import ConfigError
from router.config.loader import parse_config

from .conversation_support import MISTRAL_CONFIG, MISTRAL_JINJA, qwen_dir

QWEN = qwen_dir()
T = "kv_cache_index.conversation.templates"


def _cfg(templates: list[dict[str, Any]], enabled: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {
            "enabled": True,
            "conversation": {"enabled": enabled, "templates": templates},
        },
        "backends": [{"name": "a", "url": "http://x:1", "type": "vllm", "models": ["qwen"]}],
        **extra,
    }


def _errors(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return {i.path: i.message for i in info.value.issues}


def _qwen(**kw: Any) -> dict[str, Any]:
    return {
        "model": "qwen",
        "tokenizer_config": str(QWEN / "tokenizer_config.json"),
        "tokenizer": str(QWEN / "tokenizer.json"),
        **kw,
    }


def test_a_loading_template_passes_without_warnings() -> None:
    _, warnings = parse_config(_cfg([_qwen(lora_adapters=["qwen-sql"])]))
    assert [w for w in warnings if w.path.startswith(("kv_cache_index", "backends"))] == []


def _bad_files(tmp: Path) -> dict[str, Path]:
    (tmp / "not.json").write_text("{nope")
    (tmp / "empty.json").write_text('{"eos_token": "</s>"}')
    (tmp / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    (tmp / "lower.json").write_text(
        '{"normalizer": {"type": "Replace", "pattern": {"String": " "}}}'
    )
    return {p.name: p for p in tmp.iterdir()}


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"tokenizer_config": "missing.json"}, "tokenizer_config", "does not exist"),
        ({"tokenizer_config": "not.json"}, "tokenizer_config", "is not JSON"),
        ({"tokenizer_config": "empty.json"}, "tokenizer_config", "has no chat_template"),
        ({"chat_template": "bad.jinja"}, "chat_template", "line 1"),
        ({"chat_template": "missing.jinja"}, "chat_template", "does not exist"),
        (
            {"chat_template": str(MISTRAL_JINJA), "tokenizer": "lower.json"},
            "tokenizer",
            "'Replace' is not supported",
        ),
        ({}, "chat_template", "set tokenizer_config"),
    ],
)
def test_a_template_that_does_not_load_is_an_error_on_its_path(
    tmp_path: Path, spec: dict[str, str], field: str, message: str
) -> None:
    files = _bad_files(tmp_path)
    spec = {k: str(files.get(v, tmp_path / v)) for k, v in spec.items()}
    errors = _errors(_cfg([_qwen(), {"model": "other", **spec}]))
    assert message in errors[f"{T}[1].{field}"]
    assert not any(p.startswith(f"{T}[0]") for p in errors)


def test_templates_are_checked_even_when_the_mode_is_off(tmp_path: Path) -> None:
    errors = _errors(_cfg([{"model": "m", "chat_template": str(tmp_path / "x")}], enabled=False))
    assert f"{T}[0].chat_template" in errors


def test_a_served_name_has_one_template() -> None:
    spec = {"model": "m2", "chat_template": str(MISTRAL_JINJA), "lora_adapters": ["qwen"]}
    errors = _errors(_cfg([_qwen(), spec]))
    assert "already has a template" in errors[f"{T}[1].lora_adapters[0]"]


def test_an_engine_model_without_a_template_warns_when_the_mode_is_on() -> None:
    data = _cfg([_qwen()])
    data["backends"].append(
        {"name": "b", "url": "http://y:1", "type": "sglang", "models": ["qwen", "llama"]}
    )
    data["backends"].append({"name": "c", "url": "http://z:1", "type": "openai", "models": ["gpt"]})
    _, warnings = parse_config(data)
    assert {w.path for w in warnings if "chat template" in w.message} == {"backends[1].models[1]"}
    _, off = parse_config({**data, "kv_cache_index": {"conversation": {"templates": [_qwen()]}}})
    assert not [w for w in off if "chat template" in w.message]


def test_a_template_without_tokenizer_warns_that_nothing_is_normalized() -> None:
    spec = {
        "model": "qwen",
        "chat_template": str(MISTRAL_JINJA),
        "tokenizer_config": str(MISTRAL_CONFIG),
    }
    _, warnings = parse_config(_cfg([spec]))
    assert [w.path for w in warnings if "normalizer" in w.message] == [f"{T}[0].tokenizer"]


def test_cli_validate_prints_the_missing_template_warning(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "prefix_routing: {enabled: true}\n"
        "kv_cache_index: {enabled: true, conversation: {enabled: true}}\n"
        "backends:\n  - {name: a, url: 'http://x:1', type: vllm, models: [qwen]}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "router", "config", "validate", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "warning: backends[0].models[0]:" in r.stderr
    assert "has no chat template" in r.stderr


def test_the_render_cache_bound_defaults_and_is_checked() -> None:
    cfg, _ = parse_config(_cfg([_qwen()]))
    assert cfg.kv_cache_index.conversation.render_cache_bytes == 0
    data = _cfg([_qwen()])
    data["kv_cache_index"]["conversation"]["render_cache_bytes"] = 64 << 20
    cfg, _ = parse_config(data)
    assert cfg.kv_cache_index.conversation.render_cache_bytes == 64 << 20
    data["kv_cache_index"]["conversation"]["render_cache_bytes"] = -1
    assert "kv_cache_index.conversation.render_cache_bytes" in _errors(data)
