"""Rendering rules of ``router.conversation`` that the golden tests cannot see: vLLM's
message preparation (what the template is given), the content-format detection, every
error path, and that any message list renders or raises RenderError, nothing else."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.conversation import ChatTemplate, RenderError, load_chat_template, render_prompt
from router.conversation.content_format import detect_content_format
from router.conversation.environment import chat_environment
from router.conversation.messages import prepare_chat

from .conversation_support import MISTRAL_CONFIG, MISTRAL_JINJA, qwen_dir

QWEN = qwen_dir()


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return load_chat_template(
        str(QWEN / "tokenizer_config.json"), None, str(QWEN / "tokenizer.json")
    )


@pytest.fixture(scope="module")
def mistral() -> ChatTemplate:
    return load_chat_template(str(MISTRAL_CONFIG), str(MISTRAL_JINJA), None)


def _template(tmp_path: Path, source: str, name: str = "t.jinja") -> ChatTemplate:
    path = tmp_path / name
    path.write_text(source)
    return load_chat_template(None, str(path), None)


# --- vLLM's preparation ---------------------------------------------------------------


def test_string_format_joins_text_parts_and_null_content_is_empty(qwen: ChatTemplate) -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text"}]},
            {"role": "assistant", "content": None, "extra": 1},
        ]
    }
    conv = prepare_chat(body, qwen).conversation
    assert conv == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_openai_format_rebuilds_text_parts_but_joins_tool_results(mistral: ChatTemplate) -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]},
            {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "1"}, "2"]},
            {"role": "user", "content": None},
        ]
    }
    conv = prepare_chat(body, mistral).conversation
    assert conv == [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "tool", "content": "1\n2", "tool_call_id": "x"},
        {"role": "user", "content": []},
    ]


def test_tool_calls_are_validated_and_their_arguments_parsed(qwen: ChatTemplate) -> None:
    call = {"id": "c", "type": "function", "extra": 1, "function": {"name": "f", "x": 2}}
    body = {
        "messages": [
            {
                "role": "assistant",
                "content": "t",
                "reasoning": "why",
                "tool_calls": [
                    {**call, "function": {"name": "f", "arguments": '{"b": 1, "a": [2]}'}},
                    {**call, "function": {"name": "g", "arguments": "oops"}},
                    {**call, "function": {"name": "h", "arguments": '"s"'}},
                ],
            },
            {"role": "assistant", "content": "u", "tool_calls": []},
        ]
    }
    first, second = prepare_chat(body, qwen).conversation
    assert first["tool_calls"] == [
        {"id": "c", "function": {"arguments": {"b": 1, "a": [2]}, "name": "f"}, "type": "function"},
        {"id": "c", "function": {"arguments": {}, "name": "g"}, "type": "function"},
        {"id": "c", "function": {"arguments": "s", "name": "h"}, "type": "function"},
    ]
    assert list(first["tool_calls"][0]["function"]) == ["arguments", "name"]
    assert first["reasoning"] == first["reasoning_content"] == "why"
    assert second == {"role": "assistant", "content": "u"}


def test_tools_are_dumped_as_vllm_dumps_them(qwen: ChatTemplate) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"function": {"name": "f", "strict": True}, "x": 1}],
    }
    (tool,) = prepare_chat(body, qwen).tools or []
    assert tool == {
        "type": "function",
        "function": {"name": "f", "description": None, "parameters": None, "strict": True},
        "x": 1,
    }


def test_template_arguments_merge_as_in_vllm(qwen: ChatTemplate) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": False,
        "reasoning_effort": "high",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {
            "add_generation_prompt": True,
            "enable_thinking": False,
            "tools": [{"custom": 1}],
            "skip": "auto",
            "none": None,
        },
    }
    prepared = prepare_chat(body, qwen)
    assert prepared.add_generation_prompt is False  # the request's field wins
    assert prepared.tools == [{"custom": 1}]  # chat_template_kwargs wins over the request
    assert prepared.kwargs == {
        "tokenize": False,
        "enable_thinking": False,
        "reasoning_effort": "high",
    }


def test_the_body_is_never_mutated(qwen: ChatTemplate) -> None:
    body = {
        "model": "q",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "assistant", "content": "go on"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    before = copy.deepcopy(body)
    render_prompt(qwen, body)
    assert body == before


def test_continue_final_message_leaves_the_last_message_open(qwen: ChatTemplate) -> None:
    body = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Once "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    out = render_prompt(qwen, body)
    assert out.endswith("</think>\n\nOnce ")  # cut at the tag: no <|im_end|>, spaces kept


def test_tool_use_template_is_chosen_when_the_request_has_tools(tmp_path: Path) -> None:
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(
        '{"bos_token": {"content": "<s>"}, "chat_template": ['
        '{"name": "default", "template": "D{{ bos_token }}{{ messages[0].content }}"},'
        '{"name": "tool_use", "template": "T{% for m in messages %}{% for c in m.content %}'
        '{{ c.text }}{% endfor %}{% endfor %}{{ tools|length }}"}]}'
    )
    t = load_chat_template(str(cfg), None, None)
    assert t.templates["tool_use"].content_format == "openai"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert render_prompt(t, {"messages": msgs}) == "D<s>hi"
    assert render_prompt(t, {"messages": msgs, "tools": []}) == "Thi0"


# --- content format -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "fmt"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for c in m['content'] %}{% endfor %}{% endfor %}", "openai"),
        (
            "{% set x = messages[1:] %}{% for m in x %}{% for c in m.content %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        (
            "{% set y = messages|reverse %}{% set z = y %}{% for m in z %}"
            "{% for c in m.content|list %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for c in messages[0]['content'] %}{% endfor %}", "string"),
        (  # vLLM gives up (asserts) on an assignment to a namespace attribute
            "{% set ns = namespace() %}{% set ns.m = messages %}{% for m in messages %}"
            "{% for c in m.content %}{% endfor %}{% endfor %}",
            "string",
        ),
        (
            "{% for a, b in messages %}{% endfor %}{% for m in messages %}"
            "{% for c in m.content %}{% endfor %}{% endfor %}",
            "string",
        ),
    ],
)
def test_content_format_is_detected_as_vllm_does(source: str, fmt: str) -> None:
    assert detect_content_format(chat_environment().parse(source)) == fmt


# --- error paths ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "v"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"image_url": "http://x/y.png"},
    ],
)
def test_non_text_parts_are_refused(qwen: ChatTemplate, part: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    with pytest.raises(RenderError) as info:
        render_prompt(qwen, body)
    assert info.value.reason == "non_text"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": []}, "invalid"),
        ({"messages": "hi"}, "invalid"),
        ({"messages": [{"content": "no role"}]}, "invalid"),
        ({"messages": [{"role": "user", "content": 5}]}, "invalid"),
        ({"messages": [{"role": "user", "content": [{"type": "weird"}]}]}, "invalid"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "invalid"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "invalid"),
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "invalid",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "custom"}]},
            "invalid",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
            "invalid",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"messages": []},
            },
            "invalid",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            "unsupported",
        ),
    ],
)
def test_requests_vllm_rejects_are_render_errors(
    qwen: ChatTemplate, body: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RenderError) as info:
        render_prompt(qwen, body)
    assert info.value.reason == reason


def test_unknown_role_in_a_strict_template(mistral: ChatTemplate) -> None:
    with pytest.raises(RenderError) as info:
        render_prompt(mistral, {"messages": [{"role": "critic", "content": "x"}]})
    assert (info.value.reason, "Only user and assistant" in info.value.detail) == ("template", True)


def test_the_templates_own_raise_exception(tmp_path: Path) -> None:
    t = _template(tmp_path, "{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(RenderError) as info:
        render_prompt(t, {"messages": [{"role": "user", "content": "x"}]})
    assert (info.value.reason, info.value.detail) == ("template", "no user")


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content.nope() }}",
        "{{ messages[0].content + 1 }}",
        "{{ ().__class__() }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ],
)
def test_jinja_errors_at_render_time_are_render_errors(tmp_path: Path, source: str) -> None:
    t = _template(tmp_path, source)
    with pytest.raises(RenderError) as info:
        render_prompt(t, {"messages": [{"role": "user", "content": "x"}]})
    assert info.value.reason == "error"


def test_environment_matches_transformers_helpers(tmp_path: Path) -> None:
    t = _template(
        tmp_path,
        "{{ {'b': 'é<>', 'a': 1}|tojson }}|{{ {'b': 1, 'a': 2}|tojson(indent=1, sort_keys=true) }}"
        "|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{% generation %}G{% endgeneration %}|{{ dict(a=1)|tojson }}"
        "|{{ strftime_now('%Y') | length }}",
    )
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    out = render_prompt(t, {"messages": msgs})
    assert out == '{"b": "é<>", "a": 1}|{\n "a": 2,\n "b": 1\n}|user|G|{"a": 1}|4'


# --- anything renders or is a RenderError ---------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=20)
_part = st.one_of(
    _text,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "refusal", "image_url", "x"])},
        optional={"text": _text, "refusal": _text},
    ),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "uuid"]), _text, max_size=3),
    st.integers(),
)
_call = st.fixed_dictionaries(
    {"id": _text, "type": st.just("function")},
    optional={"function": st.fixed_dictionaries({"name": _text, "arguments": _text})},
)
_message = st.fixed_dictionaries(
    {
        "role": st.one_of(
            st.sampled_from(["system", "user", "assistant", "tool", "developer"]), _text, st.none()
        )
    },
    optional={
        "content": st.one_of(st.none(), _text, st.lists(_part, max_size=3)),
        "tool_calls": st.one_of(st.none(), st.lists(_call, max_size=2), _text),
        "tool_call_id": st.one_of(_text, st.none()),
        "reasoning": st.one_of(_text, st.none()),
        "name": _text,
    },
)
_body = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=5)},
    optional={
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _text})}
            ),
            max_size=2,
        ),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "x"]), st.booleans(), max_size=2
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(body=_body, which=st.sampled_from(["qwen", "mistral"]))
def test_any_message_list_renders_or_is_a_render_error(
    qwen: ChatTemplate, mistral: ChatTemplate, body: dict[str, Any], which: str
) -> None:
    template = qwen if which == "qwen" else mistral
    try:
        out = render_prompt(template, body)
    except RenderError as exc:
        assert exc.reason in ("non_text", "invalid", "unsupported", "template", "error")
    else:
        assert isinstance(out, str)


def test_a_template_syntax_error_names_its_line(tmp_path: Path) -> None:
    from router.conversation import TemplateLoadError

    with pytest.raises(TemplateLoadError) as info:
        _template(tmp_path, "ok\n{% if %}", name="bad.jinja")
    assert info.value.field == "chat_template" and "line 2" in info.value.message
    assert isinstance(jinja2.__version__, str)
