"""The prefix key against independently built bytes, golden hex, and properties."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from bus.prefix_key import compute_prefix_key, extract_prefix_key, truncate_utf8

GOLDEN = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "prefix_key_golden.json").read_text()
)


def sha(*parts: bytes) -> str:
    return hashlib.sha256(b"".join(parts)).hexdigest()


def key_hex(body: dict, **kw: object) -> str | None:
    k = extract_prefix_key(body, **kw)  # type: ignore[arg-type]
    return None if k is None else k.hex()


def test_openai_system_prompt_string() -> None:
    body = {
        "model": "llama-3-8b",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hi"},
        ],
    }
    want = sha(b"llama-3-8b", b"\x00", b"S", b"You are a helpful assistant.")
    assert key_hex(body) == want == GOLDEN["openai_system"]


def test_openai_content_parts_join_text_with_newline_and_skip_images() -> None:
    body = {
        "model": "m",
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "part two"},
                ],
            }
        ],
    }
    assert key_hex(body) == sha(b"m", b"\x00", b"S", b"part one\npart two")


def test_first_message_fallback_uses_m_tag() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "What is KV cache?"}]}
    want = sha(b"m", b"\x00", b"M", b"What is KV cache?")
    assert key_hex(body) == want == GOLDEN["openai_first_message"]


def test_system_after_first_user_turn_does_not_anchor() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "system", "content": "late rules"},
        ],
    }
    assert key_hex(body) == sha(b"m", b"\x00", b"M", b"first")


def test_empty_system_message_is_skipped() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
    }
    assert key_hex(body) == sha(b"m", b"\x00", b"M", b"q")


def test_developer_role_counts_as_system() -> None:
    body = {"model": "m", "messages": [{"role": "developer", "content": "rules"}]}
    assert key_hex(body) == sha(b"m", b"\x00", b"S", b"rules")


def test_anthropic_top_level_system_string_and_blocks() -> None:
    s = {"model": "claude", "system": "Be terse.", "messages": [{"role": "user", "content": "x"}]}
    assert key_hex(s) == sha(b"claude", b"\x00", b"S", b"Be terse.") == GOLDEN["anthropic_system"]
    blocks = {
        "model": "claude",
        "system": [
            {"type": "text", "text": "a"},
            {"type": "text", "text": "b", "cache_control": {}},
        ],
        "messages": [{"role": "user", "content": "x"}],
    }
    assert key_hex(blocks) == sha(b"claude", b"\x00", b"S", b"a\nb")


def test_anthropic_without_system_uses_first_message_blocks() -> None:
    body = {
        "model": "c",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
    }
    assert key_hex(body) == sha(b"c", b"\x00", b"M", b"q")


def test_truncation_cuts_back_to_utf8_boundary() -> None:
    text = "a" * 1023 + "한"  # the 3-byte code point straddles byte 1024
    body = {"model": "m", "messages": [{"role": "system", "content": text}]}
    want = sha(b"m", b"\x00", b"S", b"a" * 1023)
    assert key_hex(body, max_prefix_length=1024) == want == GOLDEN["truncated_hangul"]


def test_truncation_keeps_exact_fit() -> None:
    text = "é" * 512  # 1024 bytes exactly
    body = {"model": "m", "messages": [{"role": "system", "content": text}]}
    assert key_hex(body) == sha(b"m", b"\x00", b"S", text.encode())


def test_none_when_disabled_or_no_text() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert extract_prefix_key(body, enabled=False) is None
    assert extract_prefix_key({"model": "m", "messages": []}) is None
    assert extract_prefix_key({"model": "m", "messages": [{"role": "user", "content": ""}]}) is None
    assert extract_prefix_key({"model": "m", "system": "", "messages": []}) is None


def test_malformed_shapes_give_none_not_errors() -> None:
    for body in (
        {"model": "m", "messages": "not a list"},
        {"model": "m", "messages": [1, None, "x"]},
        {"model": "m", "messages": [{"role": "user", "content": 42}]},
        {"model": "m", "messages": [{"role": "user", "content": [1, {"type": "text"}]}]},
        {"model": 7, "messages": [{"role": "user", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}]},
    ):
        assert extract_prefix_key(body) is None


def test_model_override_and_unlimited_length() -> None:
    long = "x" * 5000
    k = compute_prefix_key("gemini-2.5", "S", long, None)
    assert k.hex() == sha(b"gemini-2.5", b"\x00", b"S", long.encode())


@given(st.text(), st.integers(min_value=0, max_value=64))
def test_truncate_never_splits_a_code_point(text: str, limit: int) -> None:
    data = text.encode("utf-8", "surrogatepass")
    cut = truncate_utf8(data, limit)
    assert len(cut) <= max(limit, 0) or len(data) <= limit
    assert data.startswith(cut)
    cut.decode("utf-8", "surrogatepass")  # raises if a code point was split
    # maximal: the next code point would not fit
    if len(cut) < len(data):
        nxt = data[len(cut) :].decode("utf-8", "surrogatepass")[:1].encode("utf-8", "surrogatepass")
        assert len(cut) + len(nxt) > limit


@given(st.text(min_size=1), st.text(min_size=1, max_size=20))
def test_system_and_first_message_forms_differ(text: str, model: str) -> None:
    s = extract_prefix_key({"model": model, "system": text, "messages": []})
    m = extract_prefix_key({"model": model, "messages": [{"role": "user", "content": text}]})
    assert s is not None and m is not None and s != m


@given(st.text(min_size=1, max_size=10), st.text(min_size=1, max_size=10), st.text(min_size=1))
def test_model_is_separated_by_nul(a: str, b: str, text: str) -> None:
    """Moving bytes between model and text never collides (unless the model has a NUL)."""
    k1 = compute_prefix_key(a, "S", b + text, None)
    k2 = compute_prefix_key(a + b, "S", text, None)
    assert k1.hex() == sha(
        a.encode("utf-8", "surrogatepass"), b"\x00S", (b + text).encode("utf-8", "surrogatepass")
    )
    if "\x00" not in a + b:
        assert k1 != k2


@given(st.text(), st.integers(min_value=1, max_value=4096))
def test_key_depends_only_on_the_truncated_prefix(text: str, n: int) -> None:
    k1 = compute_prefix_key("m", "S", text, n)
    data = truncate_utf8(text.encode("utf-8", "surrogatepass"), n)
    assert k1.hex() == sha(b"m", b"\x00S", data)
