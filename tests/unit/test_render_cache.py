"""The render cache gives every request the chain the full pass gives it, byte for byte,
turn after turn of random conversations (tools, multi-part content, system or not), for
both template families and for loop bodies that read what later messages change; and it
reuses earlier turns where the template renders message by message."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.conversation import ChatTemplate, ConversationKeys, load_chat_template
from router.conversation.render_cache import MessageDigests, RenderCache

from .conversation_support import mistral_template, qwen_template
from .test_render_fast import _conversation

MODEL = "m"


def _qwen_jinja() -> ChatTemplate:
    """Qwen's template without its segment renderer, so that plain chats (which that
    serves instead of the cache) exercise the cache too."""
    template = qwen_template()
    compiled = {n: dataclasses.replace(c, segments=None) for n, c in template.templates.items()}
    return dataclasses.replace(template, templates=compiled)


qwen = pytest.fixture(scope="module")(_qwen_jinja)
mistral = pytest.fixture(scope="module")(mistral_template)


def test_plain_chats_the_segment_renderer_serves_skip_the_cache() -> None:
    template = qwen_template()
    full, cached = _pair(template)
    messages = [{"role": "user", "content": "q " * 50}, {"role": "assistant", "content": "a"}]
    for end in (1, 2):
        body = {"model": MODEL, "messages": [*messages[:end], {"role": "user", "content": "x"}]}
        assert cached.chain(body) == full.chain(body)
    assert cached.stats()["render_cache"]["stores"] == 0
    assert cached.stats()["segments"][MODEL]["hits"] >= 2


def test_a_plain_chat_is_read_once_with_the_cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deciding that the segment renderer serves a plain chat reads its messages
    (``plain_chat``: 13-20 us at 8k tokens); rendering it then uses that reading instead
    of a second pass, and the developer role still takes vLLM's general path."""
    from router.conversation import chain as chain_module
    from router.conversation import messages as messages_module

    calls = []
    real = messages_module.plain_chat

    def counted(messages: Any) -> Any:
        calls.append(len(messages))
        return real(messages)

    monkeypatch.setattr(chain_module, "plain_chat", counted)
    monkeypatch.setattr(messages_module, "plain_chat", counted)
    full, cached = _pair(qwen_template())
    for first in ("system", "developer"):
        body = {
            "model": MODEL,
            "messages": [
                {"role": first, "content": "be brief " * 20},
                {"role": "user", "content": "q " * 50},
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "x"},
            ],
        }
        expected = full.chain(body)
        calls.clear()
        assert cached.chain(body) == expected and expected is not None
        assert len(calls) == (1 if first == "system" else 2), first


def _pair(template: ChatTemplate, cache_bytes: int = 1 << 20) -> tuple[ConversationKeys, ...]:
    return (
        ConversationKeys({MODEL: template}, chunk_bytes=64),
        ConversationKeys({MODEL: template}, chunk_bytes=64, render_cache_bytes=cache_bytes),
    )


def _turns(conv: dict[str, Any], step: int) -> list[dict[str, Any]]:
    messages = conv["messages"]
    return [
        {**conv, "model": MODEL, "messages": messages[:end]}
        for end in range(1, len(messages) + 1, step)
    ]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conv=_conversation,
    which=st.sampled_from(["qwen", "mistral"]),
    step=st.integers(1, 3),
    agp=st.booleans(),
)
def test_every_turn_keys_as_the_full_pass(
    qwen: ChatTemplate,
    mistral: ChatTemplate,
    conv: dict[str, Any],
    which: str,
    step: int,
    agp: bool,
) -> None:
    """Turn after turn (each a prefix of the next): the same chain with the cache as
    without it, or no chain either way."""
    full, cached = _pair(qwen if which == "qwen" else mistral)
    for body in _turns({**conv, "add_generation_prompt": agp}, step):
        assert cached.chain(body) == full.chain(body)
        # and the same body again (a retry): still the same chain
        assert cached.chain(body) == full.chain(body)


def _chat(turns: int, system: bool = True) -> list[dict[str, Any]]:
    out = [{"role": "system", "content": "Be brief."}] if system else []
    for t in range(turns):
        out += [
            {"role": "user", "content": f"question {t} " * 8},
            {"role": "assistant", "content": f"answer {t} " * 12},
        ]
    return [*out, {"role": "user", "content": "and then?"}]


def test_a_conversation_renders_only_its_new_messages(qwen: ChatTemplate) -> None:
    """Each turn after the first reuses the previous turn's messages (Qwen's loop reads
    ``ns.last_query_index``, set from the last user message: compared with the index
    only, so every earlier message still renders the same)."""
    full, cached = _pair(qwen)
    messages = _chat(6)
    for end in range(2, len(messages) + 1, 2):
        body = {"model": MODEL, "messages": messages[:end]}
        assert cached.chain(body) == full.chain(body)
    stats = cached.stats()["render_cache"]
    assert stats["misses"] == 1
    assert stats["hits"] == len(range(2, len(messages) + 1, 2)) - 1
    assert stats["messages_reused"] > stats["messages_rendered"]
    # the same request again (a retry) renders no message at all
    rendered = stats["messages_rendered"]
    assert cached.chain(body) == full.chain(body)
    stats = cached.stats()["render_cache"]
    assert stats["messages_rendered"] == rendered
    assert stats["hits"] == len(range(2, len(messages) + 1, 2))


def test_a_template_without_a_plan_renders_whole(mistral: ChatTemplate) -> None:
    """Mistral's loop runs over ``loop_messages`` and puts its tools before the last user
    message: no plan, every request takes the full pass (still the same chain)."""
    assert mistral.templates["default"].incremental is None
    full, cached = _pair(mistral)
    body = {"model": MODEL, "messages": _chat(2, system=False)}
    assert cached.chain(body) == full.chain(body)
    assert cached.stats()["render_cache"]["bypassed"] == 1


def _template(tmp_path: Path, source: str) -> ChatTemplate:
    path = tmp_path / "t.jinja"
    path.write_text(source)
    return load_chat_template(None, str(path), None)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if message.tool_calls is defined %}{{ message.tool_calls | tojson }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A plain ChatML template (content as text or parts, tool calls as JSON)."""

LLAMA3 = (
    "{{- bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\n' + system|string + '<|eot_id|>' }}"
    "{% if tools is not none %}{{ tools | tojson }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | string }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>' }}"
    "{% endif %}"
)
"""Llama 3's shape: the system message taken out by ``{% set messages = messages[1:] %}``
(no plan: the loop runs over the set value)."""


@pytest.mark.parametrize("source", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(conv=_conversation, step=st.integers(1, 3))
def test_chatml_and_llama_turns_key_as_the_full_pass(
    tmp_path: Path, source: str, conv: dict[str, Any], step: int
) -> None:
    template = _template(tmp_path, source)
    assert (template.templates["default"].incremental is None) == (source is LLAMA3)
    full, cached = _pair(template)
    for body in _turns(conv, step):
        assert cached.chain(body) == full.chain(body)


_LOOKING_AHEAD = [
    # what later messages change, read from the loop body in every way it can be
    "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}|{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ loop.length }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ loop.revindex }}{{ loop.revindex0 }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ loop.nextitem.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ messages[-1].content }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ messages[loop.index0 + 1].content }}{% endfor %}",
    "{% for m in messages %}{{ messages[loop.index0 - 1].content }}:{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ messages|length }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{{ messages[1:]|length }}{% endfor %}",
    "{% set last = messages[-1].content %}{% for m in messages %}{{ m.content }}{{ last }}"
    "{% endfor %}",
    "{% set n = messages|length %}{% for m in messages %}{% if loop.index0 < n - 2 %}old"
    "{% endif %}{{ m.content }}{% endfor %}",
    # a namespace set from the last user message (a scan as Qwen's), compared with the
    # index, then printed
    "{% set ns = namespace(u=0) %}{% for m in messages[::-1] %}{% if m.role == 'user' %}"
    "{% set ns.u = messages|length - loop.index %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if loop.index > ns.u %}new:{% endif %}{{ m.content }}"
    "{% endfor %}",
    "{% set ns = namespace(u=0) %}{% for m in messages[::-1] %}{% if m.role == 'user' %}"
    "{% set ns.u = messages|length - loop.index %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if ns.u >= loop.index0 %}{{ ns.u }}{% endif %}{{ m.content }}"
    "{% endfor %}",
    "{% set ns = namespace(u=0) %}{% for m in messages[::-1] %}{% if m.role == 'user' %}"
    "{% set ns.u = messages|length - loop.index %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if ns.u == loop.index0 %}last user:{% endif %}{{ m.content }}"
    "{% endfor %}",
    "{% for m in messages %}{% for p in [1, 2] %}{{ loop.last }}{% endfor %}{{ m.content }}"
    "{% if loop.previtem %}{{ loop.previtem.content }}{% endif %}{{ loop.first }}"
    "{% endfor %}",
    "{% for m in messages %}{% set x = m.content %}{{ x }}{% endfor %}{{ x }}"
    "{% if add_generation_prompt %}A:{% endif %}",
    "{% for m in messages %}{{ m.content }}{% if loop.index0 == 1 %}{% set y = 1 %}"
    "{% endif %}{{ y }}{% endfor %}",
    "{{ messages[0].content if messages else '' }}{% for m in messages %}{{ loop.cycle('a', 'b')"
    " }}{{ m.content }}{% endfor %}",
]

_short = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.text("ab", max_size=3),
        }
    ),
    min_size=1,
    max_size=7,
)


def test_the_looking_ahead_templates_have_plans(tmp_path: Path) -> None:
    """(so the test below runs the instrumented loop, not the full pass)"""
    for source in _LOOKING_AHEAD:
        assert _template(tmp_path, source).templates["default"].incremental is not None, source


@pytest.mark.parametrize("source", _LOOKING_AHEAD)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=_short, step=st.integers(1, 2))
def test_loop_bodies_that_look_ahead_key_as_the_full_pass(
    tmp_path: Path, source: str, messages: list[dict[str, Any]], step: int
) -> None:
    full, cached = _pair(_template(tmp_path, source))
    for body in _turns({"messages": messages}, step):
        assert cached.chain(body) == full.chain(body)


def test_a_bounded_cache_evicts_the_least_recent(qwen: ChatTemplate) -> None:
    full, cached = _pair(qwen, cache_bytes=4096)
    for c in range(8):
        messages = [{"role": "user", "content": f"conversation {c} " * 40}]
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        for end in (1, 3):
            body = {"model": MODEL, "messages": messages[:end]}
            assert cached.chain(body) == full.chain(body)
    stats = cached.stats()["render_cache"]
    assert stats["bytes"] <= 4096
    assert stats["evictions"] > 0


def _digests(messages: list[Any]) -> list[bytes]:
    d = MessageDigests(messages)
    return [d.digest(j) for j in range(len(messages), 0, -1)][::-1]


def test_digests_tell_messages_apart_and_find_earlier_turns() -> None:
    one = _digests([{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}])
    two = _digests([{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}])
    assert one[0] != two[0] and one[1] != two[1]
    ints = _digests([{"role": "tool", "content": "x", "tool_call_id": 1}])
    floats = _digests([{"role": "tool", "content": "x", "tool_call_id": 1.0}])
    assert ints != floats
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    longer = _digests([*turn, {"role": "user", "content": "next"}])
    assert longer[:2] == _digests(turn)
    with pytest.raises(TypeError):
        MessageDigests([{"role": "user", "content": object()}])


@settings(max_examples=100, deadline=None)
@given(
    messages=st.lists(
        st.dictionaries(
            st.text(max_size=3), st.text(max_size=3) | st.integers(-(2**63), 2**63 - 1)
        ),
        min_size=1,
        max_size=5,
    )
)
def test_a_prefix_digest_is_the_prefix_alone(messages: list[Any]) -> None:
    """The digest of the first j messages of a request is that of a request of those j."""
    whole = _digests(messages)
    for j in range(1, len(messages) + 1):
        assert whole[j - 1] == _digests(messages[:j])[-1]


def test_render_cache_bound_is_checked() -> None:
    with pytest.raises(ValueError):
        RenderCache(0)
    with pytest.raises(ValueError):
        ConversationKeys({}, chunk_bytes=64, render_cache_bytes=-1)
