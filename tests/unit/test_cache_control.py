"""cache_control injection: last system block only, caller's markers respected."""

from __future__ import annotations

import copy
from typing import Any

from router.dialects.cache_control import has_cache_control, inject_cache_control, should_inject

EPH = {"type": "ephemeral"}


def test_string_system_becomes_one_marked_block() -> None:
    body = {"system": "rules", "messages": [{"role": "user", "content": "x"}]}
    assert inject_cache_control(body)
    assert body["system"] == [{"type": "text", "text": "rules", "cache_control": EPH}]


def test_only_last_system_block_is_marked() -> None:
    body = {
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": "x"}],
    }
    assert inject_cache_control(body)
    assert "cache_control" not in body["system"][0]
    assert body["system"][1]["cache_control"] == EPH


def test_existing_marker_anywhere_skips_injection() -> None:
    base: dict[str, Any] = {
        "system": [{"type": "text", "text": "a"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
        "tools": [{"name": "t", "input_schema": {}}],
    }
    for where in ("system", "messages", "tools"):
        body = copy.deepcopy(base)
        if where == "system":
            body["system"][0]["cache_control"] = EPH
        elif where == "messages":
            body["messages"][0]["content"][0]["cache_control"] = EPH
        else:
            body["tools"][0]["cache_control"] = EPH
        before = copy.deepcopy(body)
        assert has_cache_control(body)
        assert not inject_cache_control(body)
        assert body == before


def test_no_system_no_injection() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert not inject_cache_control(body)
    assert "system" not in body


def test_precedence() -> None:
    assert should_inject(force=False, backend_auto=True)
    assert not should_inject(force=False, backend_auto=False)
    assert should_inject(force=True, backend_auto=False)
