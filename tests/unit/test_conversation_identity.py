"""A conversation's identity: the same in every turn of it, different between sessions
that share a system prompt (or a tool suite) and every full chunk of their first
request, as agent sessions opening with a short task do."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prompt_chain import chain_root
from router.conversation import ChatTemplate, ConversationKeys, load_chat_template
from router.conversation.identity import conversation_id

from .conversation_support import qwen_dir

QWEN = qwen_dir()
ROOT = chain_root("qwen", None, None)
SYSTEM = {"role": "system", "content": "You are the deployment agent. " * 40}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "kubectl", "parameters": {"type": "object", "properties": {}}},
    }
]


def _turns(task: str, turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": task}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": f"step {t}"})
        msgs.append({"role": "user", "content": f"result {t}"})
    return msgs


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return load_chat_template(
        str(QWEN / "tokenizer_config.json"), None, str(QWEN / "tokenizer.json")
    )


@pytest.fixture(scope="module")
def keys(qwen: ChatTemplate) -> ConversationKeys:
    return ConversationKeys({"qwen": qwen}, chunk_bytes=64)


def test_every_turn_of_a_conversation_has_its_first_turns_identity(
    keys: ConversationKeys,
) -> None:
    ids = set()
    for turns in range(4):
        for tools in (None, TOOLS):  # the agent path and the plain-chat path alike
            body = {"model": "qwen", "messages": _turns("deploy web", turns)}
            if tools:
                body["tools"] = tools
            chain = keys.chain(body)
            assert chain is not None
            ids.add((tools is None, chain.conversation))
    assert len(ids) == 2 and all(i is not None for _, i in ids)


def test_sessions_sharing_every_full_chunk_are_told_apart(qwen: ChatTemplate) -> None:
    """Before the identity, a conversation was found by its previous request's last
    chain key: two sessions whose opening task fits in the partial last chunk had the
    same keys, and the second looked like the next turn of the first."""
    wide = ConversationKeys({"qwen": qwen}, chunk_bytes=1024)
    a = wide.chain({"model": "qwen", "messages": _turns("deploy web", 0)})
    b = wide.chain({"model": "qwen", "messages": _turns("deploy db", 0)})
    assert a is not None and b is not None
    assert a.keys == b.keys  # the tasks differ only past the last full chunk
    assert a.conversation != b.conversation


def test_the_root_separates_tenants() -> None:
    msgs = _turns("deploy web", 1)
    body = {"messages": msgs}
    assert conversation_id(body, ROOT) != conversation_id(body, chain_root("qwen", "t1", None))


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": "hello"},
        {"messages": []},
        {"messages": [SYSTEM]},  # no user message yet
        {"messages": [SYSTEM, "user"]},
        {"messages": [{"role": "user", "content": {1, 2}}]},  # does not serialize
    ],
)
def test_a_request_without_a_user_message_has_no_identity(body: dict[str, Any]) -> None:
    assert conversation_id(body, ROOT) is None


_text = st.text(max_size=30)


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(st.tuples(st.sampled_from(["system", "developer"]), _text), max_size=2),
    opening=_text,
    later=st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), _text), max_size=6),
    other=_text,
)
def test_the_identity_is_fixed_by_the_history_up_to_the_first_user_message(
    first: list[tuple[str, str]], opening: str, later: list[tuple[str, str]], other: str
) -> None:
    head = [{"role": r, "content": c} for r, c in first]
    opened = [*head, {"role": "user", "content": opening}]
    grown = [*opened, *({"role": r, "content": c} for r, c in later)]
    assert conversation_id({"messages": grown}, ROOT) == conversation_id({"messages": opened}, ROOT)
    if other != opening:
        changed = [*head, {"role": "user", "content": other}]
        assert conversation_id({"messages": changed}, ROOT) != conversation_id(
            {"messages": opened}, ROOT
        )
