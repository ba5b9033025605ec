"""The fast rendering path (the environment's inline shortcuts) renders every request
exactly as jinja's plain immutable sandbox does, across the turns of random
conversations, for both template families; each shortcut on its own; loop bodies that
carry state, break, or read names they may set; the sandbox still refuses unsafe
attributes on every path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.conversation import ChatTemplate, RenderError, load_chat_template, render_prompt
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


def _outcome(template: ChatTemplate, body: dict[str, Any], plain: bool) -> tuple[str, str]:
    try:
        return ("ok", render_prompt(template, body, plain=plain))
    except RenderError as exc:
        return ("error", exc.reason)


def _same(template: ChatTemplate, body: dict[str, Any]) -> str:
    fast = _outcome(template, body, plain=False)
    assert fast == _outcome(template, body, plain=True)
    return fast[1]


# --- random conversations, turn after turn ----------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, -0.0, 1.0, 1.5]) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_call_id = st.text(st.sampled_from("abc0123456789"), min_size=9, max_size=12)
_tool_call = st.builds(
    lambda cid, name, args: {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": args},
    },
    _call_id,
    st.sampled_from(["get_weather", "run"]),
    st.one_of(_json.map(json.dumps), _text),
)
_content = st.one_of(
    _text,
    st.sampled_from(["<tool_response>x</tool_response>", "<think>\nr\n</think>\n\na", ""]),
    st.none(),
    st.lists(st.one_of(_text, st.builds(lambda t: {"type": "text", "text": t}, _text)), max_size=3),
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _content}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": _content},
        optional={
            "tool_calls": st.lists(_tool_call, max_size=2),
            "reasoning": _text,
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": _content, "tool_call_id": _call_id}),
)
_tool = st.builds(
    lambda name, desc, params: {
        "type": "function",
        "function": {"name": name, "description": desc, "parameters": params},
    },
    st.sampled_from(["get_weather", "run"]),
    st.one_of(st.none(), _text),
    st.one_of(st.none(), st.dictionaries(_text, _json, max_size=2)),
)
_conversation = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=9)},
    optional={
        "tools": st.lists(_tool, min_size=1, max_size=2),
        "chat_template_kwargs": st.fixed_dictionaries(
            {}, optional={"enable_thinking": st.booleans(), "x": _json}
        ),
    },
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    conv=_conversation,
    which=st.sampled_from(["qwen", "mistral"]),
    step=st.integers(1, 3),
)
def test_every_turn_renders_as_the_plain_sandbox(
    qwen: ChatTemplate,
    mistral: ChatTemplate,
    conv: dict[str, Any],
    which: str,
    step: int,
) -> None:
    """Turn after turn of one conversation (each a prefix of the next, as clients resend
    them): the same bytes as jinja's plain sandbox, or the same failure."""
    template = qwen if which == "qwen" else mistral
    messages = conv["messages"]
    for end in range(1, len(messages) + 1, step):
        body = {**conv, "messages": messages[:end]}
        _same(template, body)
        _same(template, {**body, "add_generation_prompt": False})


def test_numbers_equal_in_python_render_apart(qwen: ChatTemplate) -> None:
    """1, 1.0 and True (equal in Python) and 0.0 and -0.0 render differently as JSON."""
    outs = set()
    for value in ("1", "1.0", "true", "0.0", "-0.0"):
        body = {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_000000001",
                            "type": "function",
                            "function": {"name": "f", "arguments": f'{{"a": {value}}}'},
                        }
                    ],
                },
            ]
        }
        outs.add(_same(qwen, body))
    assert len(outs) == 5


# --- loop bodies: state between iterations, control flow, names they may set --------


def _template(tmp_path: Path, source: str) -> ChatTemplate:
    path = tmp_path / f"t{abs(hash(source))}.jinja"
    path.write_text(source)
    return load_chat_template(None, str(path), None)


_MSGS = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
]


@pytest.mark.parametrize(
    "source",
    [
        # state carried between iterations through a namespace
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ ns.n }}{{ m.content }}{% endfor %}",
        # the loop object used other than through its flags
        "{% for m in messages %}{{ loop.cycle('x', 'y') }}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{{ loop.changed(m.role) }}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% set l = loop %}{{ l.index }}{% endfor %}",
        # control flow out of the loop's body
        "{% for m in messages %}{{ m.content }}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% endfor %}",
        "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}"
        "{{ m.content }}{% endfor %}",
        # an impure filter, a macro
        "{% for m in messages %}{{ [m.content] | random }}{% endfor %}",
        "{% macro f(x) %}[{{ x }}]{% endmacro %}{% for m in messages %}{{ f(m.content) }}"
        "{% endfor %}",
        # a recursive loop, a filtered loop, a tuple target
        "{% for m in messages recursive %}{{ m.content }}{% endfor %}",
        "{% for m in messages if m.role == 'user' %}{{ m.content }}{{ loop.index }}{% endfor %}",
        # names set on some paths only, read with their value before the body
        "{% for m in messages %}{% if m.role == 'user' %}{% set y = m.content %}{% endif %}"
        "{{ y }}|{% endfor %}",
        # the target reassigned on one branch, read with an outer value after it
        "{% for m in messages %}{% if m.role == 'user' %}{% set m = {'content': x} %}"
        "{% endif %}{{ m.content ~ x }}|{% endfor %}",
        # neighbours, loop flags, outer values, a set that does not leak out of the loop
        "{% set acc = [] %}{% for m in messages %}{% set acc = acc + [m] %}"
        "{{ loop.index }}{{ loop.revindex }}{{ messages[loop.index0 - 1].content }}"
        "{{ loop.previtem.role if loop.previtem is defined }}{{ acc | length }}{{ x }}"
        "{% endfor %}{{ acc | length }}",
        # nested loops with their own loop object and break
        "{% for m in messages %}{% for c in m.content %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{{ c }}{{ loop.last }}{% endfor %}{% endfor %}",
    ],
)
def test_loop_bodies_render_as_the_plain_sandbox(tmp_path: Path, source: str) -> None:
    t = _template(tmp_path, source)
    for x in ("p", "q"):
        for end in range(1, len(_MSGS) + 1):
            body = {"messages": _MSGS[:end], "chat_template_kwargs": {"x": x, "y": x + "!"}}
            _same(t, body)


# --- the inline fast paths, one by one --------------------------------------------------

_FAST_PATH_SOURCES = [
    # loop flags over a list, a tuple, and iterables that keep jinja's own LoopContext
    "{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
    "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.depth }}"
    "{{ loop.previtem.role if loop.previtem is defined }}|"
    "{{ loop.nextitem.role if loop.nextitem is defined }}|{{ loop.cycle('a', 'b') }}"
    "{{ loop.changed(m.role) }};{% endfor %}",
    "{% for c in (1, 2, 3) %}{{ loop.last }}{{ loop.nextitem }}{% endfor %}",
    "{% for c in messages[0].content %}{{ c }}{{ loop.last }}{{ loop.length }}{% endfor %}",
    "{% for k, v in messages[0].items() %}{{ k }}={{ v }}{{ loop.last }};{% endfor %}",
    "{% for i in range(3) %}{{ loop.revindex }}{{ loop.last }}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ loop.last }}{% endfor %}",
    "{% for m in messages recursive %}{{ loop.depth }}{{ loop.last }}{% endfor %}",
    "{% for m in [] %}x{% else %}empty{{ loop is defined }}{% endfor %}",
    # attributes and items of dicts, present, absent, holding an undefined
    "{{ messages[0].role }}{{ messages[0].nope }}|{{ messages[0]['role'] }}"
    "{{ messages[0]['nope'] }}|{{ messages[0].nope is defined }}"
    "{{ messages[0].role is defined }}{{ messages[0].nope is not defined }}",
    "{% set d = {'a': nothing, 'items': 1} %}{{ d.a is defined }}{{ d.items is defined }}"
    "{{ d['items'] }}{{ (d.items() | list) | length }}",
    "{% if messages[0].nope %}yes{% elif messages[0].role %}role{% endif %}"
    "{% if messages[0].content %}c{% else %}none{% endif %}",
    "{% if messages[0].nope is defined and messages[0].nope.deeper %}x{% endif %}",
    # items by computed index: lists in and out of range, negative, bools, other types
    "{% for m in messages %}{{ messages[loop.index0 - 1].role }}|{{ messages[loop.index0 + 1] }}"
    "|{{ messages[loop.index0 + 1].role if not loop.last }}{% endfor %}"
    "{{ messages[-1].content }}{{ messages[-9] }}{{ messages[true] is defined }}{{ messages[0.0] }}"
    "{{ messages[0].content[1] }}{{ messages[0].content[-1] }}{{ (1, 2)[1] }}"
    "{{ messages[messages[0]['role'] == 'user'] }}{{ messages[0][0] }}",
    # str and dict methods, and the sandbox's own for other objects
    "{{ messages[0].content.startswith('a') }}{{ messages[0].content.split('b') }}"
    "{{ messages[0].content.strip().upper() }}{{ messages[0].get('role') }}"
    "{{ messages[0].get('nope', 'dflt') }}{{ messages[0].keys() | list }}"
    "{{ messages[0].content.replace('a', 'b', 1) }}{{ 'x'.join(['a', 'b']) }}",
    "{% set ns = namespace(startswith=1) %}{{ ns.startswith }}{{ messages.count(1) }}",
    # names a loop resolves from the context (once per loop): read before and after a set
    "{% for m in messages %}[{{ content }}{% set content = m.content %}{{ content }}"
    "{% for c in m.content %}({{ x }}{% set x = c %}{{ x }}){% endfor %}{{ x }}]{% endfor %}"
    "{{ content }}{% set content = 'top' %}{% for m in messages %}{{ content }}{% endfor %}",
    # namespaces
    "{% set ns = namespace(a=1, b=messages) %}{% for m in messages %}{% set ns.a = ns.a + 1 %}"
    "{% endfor %}{{ ns.a }}{{ ns.b | length }}{{ ns.c }}{{ ns.c is defined }}",
]
_FAST_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "abc"}]},
    {
        "messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}],
        "chat_template_kwargs": {"content": "K", "x": 1},
    },
    {
        "messages": [
            {"role": "system", "content": " a b "},
            {"role": "user", "content": "bab"},
            {"role": "assistant", "content": "ok"},
        ]
    },
]


@pytest.mark.parametrize("source", _FAST_PATH_SOURCES)
def test_fast_paths_render_as_the_plain_sandbox(tmp_path: Path, source: str) -> None:
    t = _template(tmp_path, source)
    for body in _FAST_BODIES:
        assert _same(t, body) != "error", source


_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(st.characters(codec="utf-8")),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3) | st.integers(-2, 2) | st.none(), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(value=_any_json)
def test_tojson_is_transformers_tojson(value: Any) -> None:
    from router.conversation.environment import _tojson, _tojson_plain

    assert _tojson(value) == _tojson_plain(value) == json.dumps(value, ensure_ascii=False)
    assert _tojson(value, indent=1) == json.dumps(value, ensure_ascii=False, indent=1)


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(
        st.dictionaries(
            st.sampled_from(["role", "content", "name", "tool_call_id", "tools"]),
            st.one_of(_text, st.none(), st.sampled_from(["user", "developer", "tool"])),
            max_size=3,
        )
        | st.fixed_dictionaries(
            {"content": _text, "role": st.sampled_from(["user", "assistant", "developer"])}
        ),
        max_size=4,
    ),
    which=st.sampled_from(["qwen", "mistral"]),
)
def test_the_inline_message_preparation_is_vllms(
    qwen: ChatTemplate, mistral: ChatTemplate, messages: list[Any], which: str
) -> None:
    """prepare_chat's inline case builds what _message builds, keys in the same order."""
    from router.conversation.messages import _message

    template = qwen if which == "qwen" else mistral
    fmt = template.templates["default"].content_format
    try:
        expected = [list(_message(m, fmt).items()) for m in messages]
    except RenderError:
        with pytest.raises(RenderError):
            prepare_chat({"messages": messages}, template)
        return
    got = prepare_chat({"messages": messages}, template).conversation
    assert [list(m.items()) for m in got] == expected


# --- the sandbox on every path ----------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages[0].content.__class__.__base__.__subclasses__() }}",
        "{% for m in messages %}{{ m.content.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ m.content.startswith.__self__.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ m.items.__self__.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ m.content.format.__self__.__class__.__mro__ }}{% endfor %}",
        "{% set ns = namespace() %}{{ ns.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% for m in messages %}{{ m.update({'a': 1}) }}{% endfor %}",
        "{% for m in messages %}{{ loop._iterable.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ loop.__init__.__globals__ }}{% endfor %}",
        "{% set ns = namespace() %}{{ ns._Namespace__attrs.__class__.__mro__ }}",
        "{% set ns = namespace() %}{{ ns.__getattr__.__globals__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
    ],
)
def test_unsafe_attributes_fail_on_the_fast_path(tmp_path: Path, source: str) -> None:
    t = _template(tmp_path, source)
    body = {"messages": [{"role": "user", "content": "x"}]}
    for plain in (False, True):
        with pytest.raises(RenderError) as info:
            render_prompt(t, body, plain=plain)
        assert info.value.reason == "error"
