"""The segment renderer (plain chats by concatenation, per learned shape) gives exactly
what jinja's plain sandbox renders: for random plain chats on Qwen's template (whose
content questions, ``</think>`` and ``<tool_response>``, become predicates), and for
templates that look at contents in ways it must not reproduce (those shapes render with
jinja); bounded; off for templates whose output changes between renders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.conversation import ChatTemplate, load_chat_template, render_prompt
from router.conversation import segments as seg_mod
from router.conversation.messages import plain_chat, prepare_chat
from router.conversation.render import render_inputs

from .conversation_support import qwen_dir

QWEN = qwen_dir()


def _qwen() -> ChatTemplate:
    return load_chat_template(
        str(QWEN / "tokenizer_config.json"), None, str(QWEN / "tokenizer.json")
    )


def _jinja(tmp_path: Path, source: str, name: str = "t.jinja") -> ChatTemplate:
    path = tmp_path / name
    path.write_text(source)
    return load_chat_template(None, str(path), None)


def _stats(template: ChatTemplate) -> dict[str, int]:
    segments = template.templates["default"].segments
    assert segments is not None
    return segments.stats()


def _body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, **extra}


def _same(template: ChatTemplate, body: dict[str, Any]) -> str:
    fast = render_prompt(template, body)
    assert fast == render_prompt(template, body, plain=True)
    return fast


# --- Qwen, random plain chats -------------------------------------------------------------

_piece = st.sampled_from(
    [
        *("", " ", "\n", "\t", "<", "</think>", "<think>", "<tool_response>", "</tool_response>"),
        *("<|im_end|>", "é", "e\u0301", '"', "\\", "x", "hello world", "\ue000", "\ue001"),
    ]
)
_content = st.lists(_piece, max_size=5).map("".join)
_roles = st.sampled_from(["system", "user", "assistant", "tool"])
_chat = st.lists(st.tuples(_roles, _content), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_chat, st.booleans(), st.sampled_from([None, True, False]))
def test_plain_chats_render_as_jinja_does(
    chat: list[tuple[str, str]], generation_prompt: bool, thinking: bool | None
) -> None:
    template = _qwen()
    extra: dict[str, Any] = {"add_generation_prompt": generation_prompt}
    if thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": thinking}
    messages = [{"role": r, "content": c} for r, c in chat]
    before = _stats(template)["hits"]
    _same(template, _body(messages, **extra))
    # a second conversation of the same shape, other contents: the learned shape serves it
    _same(template, _body([{"role": r, "content": c + " more"} for r, c in chat], **extra))
    assert _stats(template)["hits"] >= before


def test_a_common_chat_is_served_by_concatenation() -> None:
    template = _qwen()
    shape = ["system", "user", "assistant", "user"]
    before = _stats(template)
    for n in range(5):
        _same(template, _body([{"role": r, "content": f"{r} {n}\n"} for r in shape]))
    after = _stats(template)
    # the first of a new shape renders with jinja; it is learned when it comes again
    assert after["hits"] - before["hits"] >= 4
    assert after["learned"] - before["learned"] <= 1


def test_a_shape_seen_once_costs_no_probe_renders(tmp_path: Path) -> None:
    template = _jinja(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    for n in range(1, 6):  # five shapes, each once
        _same(template, _body([{"role": "user", "content": "x"}] * n))
    stats = _stats(template)
    assert stats["first_seen"] == 5 and stats["learned"] == 0 and stats["hits"] == 0
    _same(template, _body([{"role": "user", "content": "y"}] * 3))  # the third, again
    stats = _stats(template)
    assert stats["learned"] == 1 and stats["hits"] == 1


def test_a_content_answering_a_question_otherwise_renders_with_jinja() -> None:
    template = _qwen()
    plain = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    plain.append({"role": "user", "content": "q2"})
    _same(template, _body(plain))
    before = _stats(template)["refused"]
    thought = [dict(m) for m in plain]
    thought[1]["content"] = "<think>\nr\n</think>\n\na"
    text = _same(template, _body(thought))
    assert "<think>" not in text  # the template cut the reasoning out: jinja rendered it
    assert _stats(template)["refused"] == before + 1


def test_messages_beyond_plain_text_are_served_by_their_slots() -> None:
    """Other keys, another key order, text parts, a null content: as vLLM prepares them,
    every message still holds only strings, so each shape is learned and served."""
    template = _qwen()
    cases: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        [{"role": "user", "content": "x", "name": "bob"}],
        [{"content": "x", "role": "user"}],
        [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
    ]
    for messages in cases:
        _same(template, _body(messages))  # seen once
        before = _stats(template)["hits"]
        _same(template, _body(messages))
        assert _stats(template)["hits"] == before + 1


def test_media_parts_are_still_refused() -> None:
    from router.conversation import RenderError

    body = _body([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(RenderError) as err:
        render_prompt(_qwen(), body)
    assert err.value.reason == "non_text"


# --- agent loops: tools, tool calls, tool results -----------------------------------------

_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


def _agent(step: str, turns: int, args: str = '{"cmd": "ls"}') -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": f"task {step}"},
    ]
    for t in range(turns):
        cid = f"call_{step}{t:04d}"
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": cid,
                        "type": "function",
                        "function": {"name": "run_shell", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": cid, "content": f"out {step} {t}"},
        ]
    return msgs


def test_an_agent_loop_is_served_by_concatenation() -> None:
    template = _qwen()
    before = _stats(template)
    for n in range(5):
        _same(template, _body(_agent(str(n), 3, f'{{"cmd": "ls {n}", "n": {n}}}'), tools=_TOOLS))
    after = _stats(template)
    # the first renders with jinja (a shape seen once), the second learns it
    assert after["hits"] - before["hits"] >= 4
    assert after["learned"] - before["learned"] <= 1


def test_an_agent_loop_seen_once_is_rendered_once(tmp_path: Path) -> None:
    """Read in one pass and not served (a shape seen for the first time), an agent loop
    goes straight to jinja: not read again from vLLM's messages, which would give the
    same shape and learn it at once."""
    template = _qwen()
    stats = template.select(True).segments
    assert stats is not None
    before = stats.stats()
    body = _body(_agent("once", 7, '{"cmd": "once"}'), tools=_TOOLS)
    _same(template, body)
    after = stats.stats()
    assert after["first_seen"] - before["first_seen"] == 1
    assert after["learned"] == before["learned"] and after["hits"] == before["hits"]


def test_the_tools_are_part_of_the_shape() -> None:
    """Equal tools (by their JSON) share a shape; other tools are another shape, whose
    prompt carries them."""
    template = _qwen()
    other = [{**_TOOLS[0], "function": {**_TOOLS[0]["function"], "description": "Other"}}]
    before = _stats(template)["learned"]
    first = _same(template, _body(_agent("a", 1), tools=_TOOLS))
    _same(template, _body(_agent("b", 1), tools=json.loads(json.dumps(_TOOLS))))
    assert _stats(template)["learned"] - before <= 1
    second = _same(template, _body(_agent("a", 1), tools=other))
    assert "Other" in second and "Other" not in first


_call_args = st.dictionaries(
    st.sampled_from(["cmd", "n", "é", 'q"']),
    st.one_of(_content, st.integers(-2, 2), st.booleans(), st.none()),
    max_size=3,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["user", "assistant", "system"]), _content),
            st.tuples(st.just("call"), _call_args),
            st.tuples(st.just("tool"), _content),
        ),
        min_size=1,
        max_size=7,
    ),
    st.booleans(),
)
def test_agent_loops_render_as_jinja_does(steps: list[tuple[str, Any]], tools: bool) -> None:
    """Random tool calls (arguments of every JSON kind), results and turns, twice with
    other texts of the same shape: what jinja's plain sandbox renders."""
    template = _qwen()

    def messages(tag: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, (kind, value) in enumerate(steps):
            if kind == "call":
                fn = {"name": f"f{tag}", "arguments": json.dumps(value)}
                call = {"id": f"c{tag}{i}", "type": "function", "function": fn}
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "tool":
                out.append({"role": "tool", "tool_call_id": f"c{tag}{i}", "content": value + tag})
            else:
                out.append({"role": kind, "content": value + tag})
        return out

    extra: dict[str, Any] = {"tools": _TOOLS} if tools else {}
    _same(template, _body(messages(""), **extra))
    _same(template, _body(messages("x"), **extra))


@pytest.mark.parametrize(
    ("arguments", "served"),
    [
        ("{{ c.function.arguments | tojson }}", True),
        ("{{ c.function.arguments | tojson(indent=2) }}", False),
        ("{{ c.function.arguments | length }}", False),
        ("{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}", False),
        ("{{ c.function.arguments['cmd'] }}", False),
        ("{% if c.function.arguments %}A{% endif %}", False),
        ("{{ (c.function.arguments | tojson)[1:] }}", False),
        # a question about the JSON text: the probe answers otherwise, so refused
        ("{% if (c.function.arguments | tojson).startswith('{') %}J{% endif %}", False),
    ],
)
def test_arguments_looked_at_render_as_jinja_does(
    tmp_path: Path, arguments: str, served: bool
) -> None:
    template = _jinja(
        tmp_path,
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<{{ c.id }}:{{ c.function.name }}:" + arguments + ">{% endfor %}{% endfor %}",
    )
    for args in ('{"cmd": "a b"}', '{"cmd": "x", "n": 1}', "{}", '{"cmd": "\u00e9""}'):
        _same(template, _body(_agent("s", 2, args)))
    assert (_stats(template)["hits"] > 0) is served


def test_plain_chat_takes_exactly_role_then_content() -> None:
    assert plain_chat([{"role": "user", "content": "x"}]) == (("user",), ["x"])
    assert plain_chat([]) is None
    assert plain_chat([{"content": "x", "role": "user"}]) is None
    assert plain_chat([{"role": "user", "content": None}]) is None
    assert plain_chat([{"role": 1, "content": "x"}]) is None
    assert plain_chat([{"role": "user", "text": "x"}]) is None
    assert plain_chat(["user"]) is None


# --- templates that look at contents --------------------------------------------------

_CONTENTS = ["a", "  padded  ", "", "line\nbreak", 'quote " and \\', "<b>&</b>", "ü" * 5]


@pytest.mark.parametrize(
    ("source", "served"),
    [
        ("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}", True),
        ("{% for m in messages %}{{ m.content | trim }}|{% endfor %}", True),
        ("{% for m in messages %}{% if m.content %}{{ m.content }}{% endif %};{% endfor %}", True),
        ("{% for m in messages %}{{ m.content | length }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content | tojson }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content[:3] }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content.upper() }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content | e }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content.split() | join(',') }}{% endfor %}", False),
        ("{% for m in messages %}{{ ('x' + m.content).strip() }}{% endfor %}", False),
        ("{% for m in messages %}{{ m.content ~ '!' }}{% endfor %}", True),
        ("{{ messages | map(attribute='content') | join('\\n') }}", True),
        ("{% for m in messages %}{{ m.content | safe }}{% endfor %}", True),
    ],
)
def test_contents_looked_at_render_as_jinja_does(tmp_path: Path, source: str, served: bool) -> None:
    template = _jinja(tmp_path, source)
    for content in _CONTENTS:
        _same(
            template,
            _body([{"role": "user", "content": content}, {"role": "user", "content": "b"}]),
        )
    hits = _stats(template)["hits"]
    assert (hits > 0) is served


@pytest.mark.parametrize(
    "source",
    [
        "{{ strftime_now('%H:%M') }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% set f = '%Y' %}{{ strftime_now(f) }}{% for m in messages %}{{ m.content }}{% endfor %}",
        "{% set clock = strftime_now %}{{ clock('%Y') }}{% for m in messages %}{{ m.content }}"
        "{% endfor %}",
        "{% for m in messages %}{% if (m.content ~ '').endswith('x') %}X{% endif %}{% endfor %}",
        "{% for m in messages %}{% set s = '%s' % m.content %}{{ s.strip() }}{% endfor %}",
        "{% for m in messages %}{% if m.content | int > 2 %}big{% endif %}{% endfor %}",
        "{% for m in messages %}{{ m.content | urlize }}{% endfor %}",
        "{% for m in messages %}{{ m.content | wordwrap(20) }}{% endfor %}",
        "{% for m in messages %}{% if (m.content | safe).endswith('x') %}X{% endif %}{% endfor %}",
    ],
)
def test_no_segment_renderer_for_unstable_or_untraced_templates(
    tmp_path: Path, source: str
) -> None:
    template = _jinja(tmp_path, source)
    assert template.templates["default"].segments is None
    _same(template, _body([{"role": "user", "content": "ax"}]))


def test_a_raising_shape_still_raises(tmp_path: Path) -> None:
    template = _jinja(
        tmp_path,
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m.content }}{% endfor %}",
    )
    from router.conversation import RenderError

    with pytest.raises(RenderError):
        render_prompt(template, _body([{"role": "tool", "content": "x"}]))
    assert render_prompt(template, _body([{"role": "user", "content": "x"}])) == "x"


def test_shapes_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seg_mod, "MAX_SHAPES", 4)
    template = _jinja(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    for n in range(1, 12):
        body = _body([{"role": "user", "content": "x"}] * n)
        for _ in range(2):  # learned the second time
            assert render_prompt(template, body) == "<user>x" * n
    stats = _stats(template)
    assert stats["shapes"] == 4
    assert stats["learned"] == 11


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "x"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
        [{"role": "developer", "content": "d"}, {"role": "user", "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    ],
)
def test_a_body_without_template_fields_prepares_as_the_general_path(
    messages: list[dict[str, Any]],
) -> None:
    """``tools: null`` takes the general path and means the same as no ``tools``."""
    template = _qwen()
    body = _body(messages, max_tokens=5)
    assert prepare_chat(body, template) == prepare_chat({**body, "tools": None}, template)


def test_a_filter_working_on_str_of_a_content_makes_the_shape_opaque(tmp_path: Path) -> None:
    """``replace`` works on ``str(value)``: that string is traced too."""
    template = _jinja(
        tmp_path, "{% for m in messages %}{{ m.content | replace('<|x|>', '') }};{% endfor %}"
    )
    assert _same(template, _body([{"role": "user", "content": "a<|x|>b"}])) == "ab;"
    assert _same(template, _body([{"role": "user", "content": "c"}])) == "c;"
    assert _stats(template)["hits"] == 0


def test_a_first_concatenation_unlike_jinja_makes_the_shape_opaque(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net: a shape's first concatenation is checked against jinja's render
    (here the learned pieces are replaced by wrong ones, before that check)."""
    template = _jinja(tmp_path, "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    renderer = template.templates["default"].segments
    assert renderer is not None
    learn = seg_mod.SegmentRenderer._learn

    def tampered(self: seg_mod.SegmentRenderer, key: Any, *args: Any) -> Any:
        learn(self, key, *args)
        wrong = seg_mod._Shape.of(("<user>!", 0), (), 1)
        self._shapes[key] = wrong
        return wrong

    body = _body([{"role": "user", "content": "x"}])
    with monkeypatch.context() as patch:
        patch.setattr(seg_mod.SegmentRenderer, "_learn", tampered)
        assert render_prompt(template, body) == "<user>x"  # seen once
        assert render_prompt(template, body) == "<user>x"  # learned (wrongly), checked
    assert render_prompt(template, body) == "<user>x"
    stats = renderer.stats()
    assert stats["mismatched"] == 1 and stats["hits"] == 0 and stats["opaque"] == 1


_raw_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"])},
        optional={"content": st.one_of(_content, st.none(), st.integers(0, 1))},
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("tool"),
            "content": _content,
            "tool_call_id": st.sampled_from(["", "c1", 7]),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(_content, st.none()),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": st.sampled_from(["c1", "", None]),
                        "type": st.sampled_from(["function", "other"]),
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.sampled_from(["f", ""]),
                                "arguments": st.one_of(
                                    _call_args.map(json.dumps),
                                    st.sampled_from(["[1]", '"s"', "not json", "{}"]),
                                ),
                            }
                        ),
                    },
                    optional={"index": st.just(0)},
                ),
                max_size=2,
            ),
        },
        optional={"reasoning": _content},
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_raw_message, min_size=0, max_size=6), st.booleans(), st.booleans())
def test_agent_slots_read_what_prepare_chat_gives(
    messages: list[dict[str, Any]], tools: bool, other_field: bool
) -> None:
    """The one-pass reading of an agent loop, where it applies, is the signature and the
    slot values of vLLM's prepared messages; the prompt is jinja's either way."""
    from router.conversation import RenderError
    from router.conversation.messages import agent_slots

    template = _qwen()
    extra: dict[str, Any] = {"tools": _TOOLS} if tools else {}
    if other_field:
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    body = _body(messages, **extra)
    slots = agent_slots(body, template)
    if slots is not None:
        inputs = render_inputs(template, body)
        segments = inputs.prepared.template.segments
        assert segments is not None
        values: list[str] = []
        assert seg_mod._signature(inputs.chat, values, segments.tojson) == slots.signature
        assert values == slots.values
        assert slots.tools == inputs.prepared.tools
    try:
        fast = render_prompt(template, body)
    except RenderError as exc:
        with pytest.raises(RenderError) as ref:
            render_prompt(template, body, plain=True)
        assert ref.value.reason == exc.reason
    else:
        assert fast == render_prompt(template, body, plain=True)


def test_an_agent_loop_with_tools_is_read_in_one_pass() -> None:
    from router.conversation.messages import agent_slots

    body = _body(_agent("a", 2), tools=_TOOLS)
    assert agent_slots(body, _qwen()) is not None
    assert agent_slots({**body, "add_generation_prompt": False}, _qwen()) is None


# --- an agent loop's next step reads only what it adds ----------------------------------


class _Memo:
    """``agent_slots`` with a memo of its own (the module's is shared by every test)."""

    def __init__(self, max_cost: int = 16 << 20) -> None:
        from router.conversation import messages

        self.module = messages
        self.memo = messages._ReadingMemo(max_cost)

    def read(self, body: dict[str, Any], template: ChatTemplate) -> Any:
        return self._with(self.memo, body, template)

    def fresh(self, body: dict[str, Any], template: ChatTemplate) -> Any:
        return self._with(self.module._ReadingMemo(0), body, template)

    def _with(self, memo: Any, body: dict[str, Any], template: ChatTemplate) -> Any:
        saved = self.module._READINGS
        self.module._READINGS = memo
        try:
            return self.module.agent_slots(body, template)
        finally:
            self.module._READINGS = saved


def _reading(slots: Any) -> tuple[Any, ...]:
    return (slots.template, slots.tools, slots.signature, list(slots.values))


def test_an_agent_loops_next_step_reuses_its_last_reading() -> None:
    m, template = _Memo(), _qwen()
    first = m.read(_body(_agent("a", 2), tools=_TOOLS), template)
    assert first is not None and (m.memo.hits, m.memo.misses) == (0, 1)
    body = _body(_agent("a", 3), tools=_TOOLS)
    slots = m.read(body, template)
    assert m.memo.hits == 1
    assert _reading(slots) == _reading(m.fresh(body, template))
    assert _reading(m.read(body, template)) == _reading(slots)  # the same request again
    assert m.memo.hits == 2
    assert list(first.values) == _reading(m.fresh(_body(_agent("a", 2)), template))[3]


def test_an_edited_history_is_read_again() -> None:
    m, template = _Memo(), _qwen()
    m.read(_body(_agent("a", 3), tools=_TOOLS), template)
    edited = _agent("a", 4)
    edited[3]["content"] = "out a 0, edited"  # the first tool result
    body = _body(edited, tools=_TOOLS)
    slots = m.read(body, template)
    assert (m.memo.hits, m.memo.misses) == (0, 2)
    assert "out a 0, edited" in slots.values
    assert _reading(slots) == _reading(m.fresh(body, template))
    shorter = _body(_agent("a", 1), tools=_TOOLS)  # fewer messages than were kept
    assert _reading(m.read(shorter, template)) == _reading(m.fresh(shorter, template))
    assert m.memo.hits == 0


def test_a_reading_kept_under_one_template_serves_another_right(tmp_path: Path) -> None:
    """The reading depends on the template only through its ``tojson`` (reused when it
    is the same filter, read again when not): the slots are a fresh reading's."""
    m, qwen = _Memo(), _qwen()
    other = _jinja(
        tmp_path,
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
        "\n{% endfor %}",
    )
    m.read(_body(_agent("a", 2), tools=_TOOLS), qwen)
    body = _body(_agent("a", 3), tools=_TOOLS)
    slots = m.read(body, other)
    assert _reading(slots) == _reading(m.fresh(body, other))
    assert slots.template is other.select(True)


def test_the_readings_memo_is_bounded() -> None:
    m, template = _Memo(max_cost=2_000), _qwen()
    for n in range(40):
        m.read(_body(_agent(f"task {n}", 3), tools=_TOOLS), template)
    assert 0 < len(m.memo) < 40 and m.memo.cost <= 2_000
    m.read(_body(_agent("task 39", 4), tools=_TOOLS), template)  # the newest is still kept
    assert m.memo.hits == 1
    huge = _body(_agent("x" * 3_000, 3), tools=_TOOLS)
    assert m.read(huge, template) is not None  # too large to keep: read, not kept
    assert m.memo.cost <= 2_000


def test_a_reading_is_reused_only_with_the_same_tojson() -> None:
    import orjson

    m, template = _Memo(), _qwen()
    m.read(_body(_agent("a", 2), tools=_TOOLS), template)
    serialized = orjson.dumps(_agent("a", 3))
    key = m.memo.key(_agent("a", 3))
    assert key is not None
    assert m.memo.find(key, serialized, json.dumps) is None  # another filter: read again
    assert m.memo.misses == 2


def test_messages_that_are_not_json_are_read_and_not_kept() -> None:
    m, template = _Memo(), _qwen()
    body = _body([*_agent("a", 1), {"role": "user", "content": "more", "x": {1, 2}}])
    assert m.read(body, template) is None  # not a message the one-pass reading takes
    assert len(m.memo) == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_raw_message, min_size=1, max_size=6),
    st.lists(st.lists(_raw_message, max_size=3), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 20), _raw_message), max_size=2),
    st.booleans(),
)
def test_a_conversations_turns_read_as_fresh_readings(
    history: list[dict[str, Any]],
    turns: list[list[dict[str, Any]]],
    edits: list[tuple[int, dict[str, Any]]],
    tools: bool,
) -> None:
    """Turn after turn, some with an earlier message replaced: every reading through the
    memo is the one a memo-free reading gives."""
    m, template = _Memo(), _qwen()
    extra: dict[str, Any] = {"tools": _TOOLS} if tools else {}
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    messages += history
    for added in turns:
        messages = messages + added
        for at, replacement in edits:
            if 2 <= at < len(messages) and at % 3 == len(added) % 3:
                messages[at] = replacement
        body = _body(json.loads(json.dumps(messages)), **extra)  # a new request's objects
        got, want = m.read(body, template), m.fresh(body, template)
        assert (got is None) == (want is None)
        if got is not None:
            assert _reading(got) == _reading(want)


# --- the date in the prompt ---------------------------------------------------------------

_DATED = (
    "{%- if strftime_now is defined %}{% set today = strftime_now('%d %b %Y') %}"
    "{% else %}{% set today = '26 Jul 2024' %}{% endif -%}"
    "Today is {{ today }}.\n{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}\n"
    "{% endfor %}"
)


def test_random_text_gets_no_segment_renderer(tmp_path: Path) -> None:
    template = _jinja(tmp_path, "{{ lipsum(1) }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template.templates["default"].segments is None


def test_a_template_showing_the_date_is_served(tmp_path: Path) -> None:
    template = _jinja(tmp_path, _DATED)
    for n in range(3):
        text = _same(template, _body([{"role": "user", "content": f"q{n}"}]))
        assert text.startswith("Today is ") and "2024" not in text
    assert _stats(template)["hits"] == 2  # the first renders with jinja


def test_every_shape_is_learned_again_when_the_date_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime as real

    from router.conversation import environment

    day = [real.datetime(2026, 12, 2, 23, 59, 59)]

    class _Clock:
        @staticmethod
        def now() -> real.datetime:
            return day[0]

    monkeypatch.setattr(environment, "datetime", _Clock)
    template = _jinja(tmp_path, _DATED)
    body = _body([{"role": "user", "content": "q"}])
    for _ in range(2):  # learned the second time
        assert _same(template, body).startswith("Today is 02 Dec 2026.")
    day[0] = real.datetime(2026, 12, 3, 0, 0, 1)
    assert _same(template, body).startswith("Today is 03 Dec 2026.")
    stats = _stats(template)  # (learned again at once: it was in use)
    assert stats["date_changes"] == 1 and stats["learned"] == 2 and stats["mismatched"] == 0


def test_text_parts_are_served_for_an_openai_format_template() -> None:
    """Mistral's template walks content parts (content format "openai") and shows the
    date: its plain chats are served by their parts' slots."""
    from .conversation_support import MISTRAL_CONFIG, MISTRAL_JINJA

    template = load_chat_template(str(MISTRAL_CONFIG), str(MISTRAL_JINJA), None)
    assert template.templates["default"].content_format == "openai"
    for n in range(3):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"sys {n}"},
            {"role": "user", "content": [{"type": "text", "text": f"q {n}"}]},
            {"role": "assistant", "content": f"a {n}"},
            {"role": "user", "content": f"q2 {n}"},
        ]
        _same(template, _body(messages))
    assert _stats(template)["hits"] == 2


def test_the_arguments_memo_is_bounded() -> None:
    from router.conversation.messages import _ArgumentsMemo

    memo = _ArgumentsMemo(max_chars=100, max_raw=30)
    for n in range(50):
        assert memo.text(f'{{"n": {n}}}', json.dumps) == f'{{"n": {n}}}'
    assert memo.chars <= 100 and 0 < len(memo) < 50
    assert memo.text("[1]", json.dumps) is None  # not an object
    assert memo.text("not json", json.dumps) == "{}"  # vLLM's parse: {}
    assert memo.text('{"x": "' + "y" * 40 + '"}', json.dumps) is not None  # too long to keep
    assert memo.chars <= 100


@pytest.mark.parametrize(
    "tools",
    ["x", [1], [{"type": "function"}], [{"type": "function", "function": {"name": 3}}], []],
)
def test_malformed_tools_fail_as_the_general_path_does(tools: Any) -> None:
    from router.conversation import RenderError
    from router.conversation.messages import agent_slots

    body = _body(_agent("bad", 1), tools=tools)
    template = _qwen()
    if tools == []:
        assert agent_slots(body, template) is not None  # no tools to declare: valid
        _same(template, body)
        return
    assert agent_slots(body, template) is None
    with pytest.raises(RenderError) as fast:
        render_prompt(template, body)
    with pytest.raises(RenderError) as ref:
        render_prompt(template, body, plain=True)
    assert fast.value.reason == ref.value.reason == "invalid"


def test_a_kind_of_request_always_opaque_is_left_to_jinja(tmp_path: Path) -> None:
    """A template that measures tool call ids (opaque to the probes): after a few opaque
    shapes its agent loops are not read into slots for a while, and still render as
    jinja does; its plain chats are served all along."""
    template = _jinja(
        tmp_path,
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<{{ c.id | length }}:{{ c.function.name }}>{% endfor %}{% endfor %}",
    )
    for n in range(seg_mod.FUTILE_AFTER + 4):
        for _ in range(2):  # each shape twice: learned (opaque) on the second
            _same(template, _body(_agent("op", n + 1), tools=_TOOLS))
    stats = _stats(template)
    assert stats["opaque"] >= seg_mod.FUTILE_AFTER and stats["skipped"] > 0
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for _ in range(3):
        _same(template, _body(chat))
    assert _stats(template)["hits"] >= 2
