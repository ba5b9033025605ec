"""Golden: ``router.conversation`` renders every request byte for byte as ``transformers``'
``apply_chat_template`` does, for two template families (Qwen's ChatML, "string" content
format; Mistral Small 3.1's ``[INST]``, "openai" content format).

transformers gets the conversation after the same vLLM-style preparation
(``prepare_chat``), as vLLM hands it over; what that preparation does is asserted on its
own in ``test_conversation_render.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from router.conversation import ChatTemplate, load_chat_template, render_prompt
from router.conversation.messages import prepare_chat

from .conversation_support import MISTRAL_CONFIG, MISTRAL_JINJA, qwen_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen() -> tuple[ChatTemplate, Any]:
    d = qwen_dir()
    ours = load_chat_template(str(d / "tokenizer_config.json"), None, str(d / "tokenizer.json"))
    return ours, transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.fixture(scope="module")
def mistral() -> tuple[ChatTemplate, Any]:
    ours = load_chat_template(str(MISTRAL_CONFIG), str(MISTRAL_JINJA), None)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(qwen_dir() / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    return ours, tok


def reference(template: ChatTemplate, tok: Any, body: dict[str, Any]) -> str:
    """What the engine renders: vLLM's preparation, then transformers."""
    prepared = prepare_chat(body, template)
    kwargs = {k: v for k, v in prepared.kwargs.items() if k != "tokenize"}
    out = tok.apply_chat_template(
        prepared.conversation,
        tools=prepared.tools,
        documents=prepared.documents,
        chat_template=prepared.template.source,
        add_generation_prompt=prepared.add_generation_prompt,
        continue_final_message=prepared.continue_final_message,
        tokenize=False,
        **kwargs,
    )
    assert isinstance(out, str)
    return out


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt — heute",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
BARE_TOOL = {"type": "function", "function": {"name": "now"}}
CALL_ID = "call_abc123456"


def _call(args: str, name: str = "get_weather", call_id: str = CALL_ID) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


SYSTEM = {"role": "system", "content": "You are a terse assistant. Ünïcödé ✓ 日本語"}

COMMON_CASES: dict[str, dict[str, Any]] = {
    "system_user": {"messages": [SYSTEM, {"role": "user", "content": "Hello there"}]},
    "multi_turn": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6."},
            {"role": "user", "content": "Thanks 🙂"},
        ]
    },
    "no_generation_prompt": {
        "messages": [SYSTEM, {"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
    },
    "multi_part_content": {
        "messages": [
            SYSTEM,
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First part."},
                    "a bare string part",
                    {"type": "text", "text": "Third part\nwith a newline."},
                ],
            },
        ]
    },
    "tools": {
        "messages": [SYSTEM, {"role": "user", "content": "Weather in Köln?"}],
        "tools": [WEATHER, BARE_TOOL],
    },
    "tool_history": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call('{"city": "Paris", "days": 2}'),
                    _call('{"city":"Rome"}', call_id="call_def987654"),
                ],
            },
            {"role": "tool", "tool_call_id": CALL_ID, "content": "Paris: 21°C"},
            {
                "role": "tool",
                "tool_call_id": "call_def987654",
                "content": [{"type": "text", "text": "Rome:"}, {"type": "text", "text": "25°C"}],
            },
            {"role": "assistant", "content": "Paris 21°C, Rome 25°C."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        "tools": [WEATHER],
    },
    "bad_arguments_become_empty": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [_call("not json")]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        "tools": [WEATHER],
    },
}

QWEN_CASES: dict[str, dict[str, Any]] = {
    "no_system": {"messages": [{"role": "user", "content": "hi"}]},
    "reasoning_field": {
        "messages": [
            {"role": "user", "content": "think"},
            {"role": "assistant", "content": "done", "reasoning": "step 1\nstep 2"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nanswer"},
        ],
        "add_generation_prompt": False,
    },
    "thinking_disabled": {
        "messages": [{"role": "user", "content": "quick"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "continue_final_message": {
        "messages": [
            {"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Autumn moonlight—  "},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "tool_reference_and_refusal_parts": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "refusal", "refusal": "no"},
                    {"type": "input_text", "text": "x"},
                ],
            }
        ]
    },
    "nfc_and_nfd_text": {"messages": [{"role": "user", "content": "cafe\u0301 café"}]},
}

MISTRAL_CASES: dict[str, dict[str, Any]] = {
    "no_system_default_prompt": {"messages": [{"role": "user", "content": "hi"}]},
    "system_as_parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Parts system"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    },
}


def _cases(extra: dict[str, dict[str, Any]]) -> list[Any]:
    return [pytest.param(body, id=name) for name, body in {**COMMON_CASES, **extra}.items()]


@pytest.mark.parametrize("body", _cases(QWEN_CASES))
def test_qwen_matches_transformers(qwen: tuple[ChatTemplate, Any], body: dict[str, Any]) -> None:
    ours, tok = qwen
    assert ours.templates["default"].content_format == "string"
    assert render_prompt(ours, body) == reference(ours, tok, body)


@pytest.mark.parametrize("body", _cases(MISTRAL_CASES))
def test_mistral_matches_transformers(
    mistral: tuple[ChatTemplate, Any], body: dict[str, Any]
) -> None:
    ours, tok = mistral
    assert ours.templates["default"].content_format == "openai"
    assert render_prompt(ours, body) == reference(ours, tok, body)


def test_both_renderers_refuse_what_the_template_refuses(
    mistral: tuple[ChatTemplate, Any],
) -> None:
    """Mistral's template raises on a role it does not know: transformers raises the
    template's error, the router a RenderError with the template's message."""
    from router.conversation import RenderError

    ours, tok = mistral
    body = {"messages": [SYSTEM, {"role": "critic", "content": "a"}]}
    with pytest.raises(RenderError) as info:
        render_prompt(ours, body)
    assert info.value.reason == "template"
    assert "Only user and assistant roles" in info.value.detail
    with pytest.raises(Exception, match="Only user and assistant roles"):
        reference(ours, tok, body)
