"""bus.prompt_chain: the key chain both sides compute, pinned by golden vectors.

The golden file is the wire contract: a router and a listener of different versions agree
only while these values hold. One case is recomputed here from the formula itself, with
xxhash called directly, so the file cannot drift from the documented recurrence.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prompt_chain import (
    DEFAULT_CHUNK_BYTES,
    KEY_BYTES,
    ChainKey,
    ChainState,
    chain_keys,
    chain_root,
    extend,
    extend_pieces,
)

GOLDEN = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "prompt_chain_golden.json").read_text()
)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_vectors(case: dict) -> None:
    root = chain_root(case["model"], case["cache_salt"], case["lora"])
    assert root.hex() == case["root"]
    keys = chain_keys(case["text"].encode(), root, case["chunk_bytes"])
    assert [k.hex() for k in keys] == case["keys"]


def test_the_recurrence_by_hand() -> None:
    """The documented formula, written out with xxhash, gives the golden values."""
    case = next(c for c in GOLDEN["cases"] if c["cache_salt"] == "tenant-42")

    def field(s: str | None) -> bytes:
        return b"\xff" if s is None else len(s.encode()).to_bytes(4, "big") + s.encode()

    root = xxhash.xxh3_128_digest(b"continuum-chain-v1" + field("m") + field("tenant-42") + b"\xff")
    assert root.hex() == case["root"]
    text = case["text"].encode()
    k0 = xxhash.xxh3_128_digest(root + text[:1024])
    k1 = xxhash.xxh3_128_digest(k0 + text[1024:2048])
    assert [k0.hex(), k1.hex()] == case["keys"]


def test_roots_separate_model_salt_and_adapter() -> None:
    roots = {
        chain_root("m"),
        chain_root("m", ""),
        chain_root("m", "s"),
        chain_root("m", None, "s"),
        chain_root("m2"),
        chain_root("m", "a", "b"),
        chain_root("m", "b", "a"),
    }
    assert len(roots) == 7 and all(len(r) == KEY_BYTES for r in roots)


@settings(max_examples=200, deadline=None)
@given(
    text=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=6),
    chunk=st.sampled_from([1, 7, 64, DEFAULT_CHUNK_BYTES]),
)
def test_extending_in_pieces_equals_one_pass(text: bytes, cuts: list[int], chunk: int) -> None:
    root = chain_root("model", "salt")
    state = ChainState.start(root)
    keys: list[ChainKey] = []
    pos = 0
    for cut in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        state, new = extend(state, text[pos:cut], chunk)
        keys += new
        pos = cut
    assert keys == chain_keys(text, root, chunk)
    assert state.length == len(text)
    assert len(state.partial) == len(text) % chunk and text.endswith(state.partial)
    assert state.key == (keys[-1] if keys else root)


@settings(max_examples=200, deadline=None)
@given(
    text=st.binary(max_size=3000),
    cut=st.integers(0, 3000),
    splits=st.lists(st.integers(0, 3000), max_size=8),
    chunk=st.sampled_from([1, 7, 64, DEFAULT_CHUNK_BYTES]),
)
def test_extending_by_pieces_equals_one_pass(
    text: bytes, cut: int, splits: list[int], chunk: int
) -> None:
    """The listener's rope: a chain state whose partial chunk is kept in pieces, extended
    by one block, gives the one-pass keys and exactly the bytes after the last key."""
    root = chain_root("model", "salt")
    cut = min(cut, len(text))
    before = chain_keys(text[:cut], root, chunk)
    key = before[-1] if before else root
    tail = text[len(before) * chunk :]  # the partial chunk in front of the block, then it
    bounds = [0, *sorted(min(s, len(tail)) for s in splits), len(tail)]
    pieces = [tail[a:b] for a, b in itertools.pairwise(bounds)]
    keys, rest = extend_pieces(key, pieces, chunk)
    assert before + keys == chain_keys(text, root, chunk)
    assert rest == text[len(text) - len(text) % chunk :]


def test_extend_pieces_refuses_a_bad_key_or_chunk_size() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        extend_pieces(ChainKey(b"short"), [b"x" * 2048])
    with pytest.raises(ValueError, match="chunk_bytes"):
        extend_pieces(chain_root("m"), [b"abc"], 0)
    assert extend_pieces(chain_root("m"), [], 4) == ([], b"")


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=64, max_size=600), st.integers(0, 599))
def test_a_key_depends_on_every_byte_up_to_its_chunk_and_none_after(text: bytes, pos: int) -> None:
    pos %= len(text)
    root = chain_root("m")
    keys = chain_keys(text, root, 16)
    flipped = text[:pos] + bytes([text[pos] ^ 1]) + text[pos + 1 :]
    other = chain_keys(flipped, root, 16)
    changed_from = pos // 16
    assert keys[:changed_from] == other[:changed_from]
    assert all(a != b for a, b in zip(keys[changed_from:], other[changed_from:], strict=True))


def test_bad_chunk_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        chain_keys(b"abc", chain_root("m"), 0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        extend(ChainState.start(chain_root("m")), b"abc", -1)


def _by_the_recurrence(text: bytes, root: bytes, chunk: int) -> list[bytes]:
    """The module docstring's formula in plain Python: the compiled loop's reference."""
    keys, key = [], root
    for end in range(chunk, len(text) + 1, chunk):
        key = xxhash.xxh3_128_digest(key + text[end - chunk : end])
        keys.append(key)
    return keys


@settings(max_examples=300, deadline=None)
@given(
    text=st.binary(max_size=5000),
    chunk=st.one_of(st.integers(1, 70), st.sampled_from([1023, DEFAULT_CHUNK_BYTES, 1025, 6000])),
    salt=st.one_of(st.none(), st.text(max_size=8)),
)
def test_the_compiled_loop_is_the_recurrence(text: bytes, chunk: int, salt: str | None) -> None:
    root = chain_root("m", salt)
    expected = _by_the_recurrence(text, root, chunk)
    assert chain_keys(text, root, chunk) == expected
    # any bytes-like input gives the same keys
    assert chain_keys(memoryview(text), root, chunk) == expected  # type: ignore[arg-type]
    assert chain_keys(bytearray(text), root, chunk) == expected  # type: ignore[arg-type]
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in expected)


def test_the_compiled_loop_refuses_what_is_not_bytes() -> None:
    root = chain_root("m")
    with pytest.raises(TypeError):
        chain_keys("text, not bytes" * 100, root, 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chain_keys(b"x" * 64, 12345, 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chain_keys(b"x" * 64, root, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16 bytes"):
        chain_keys(b"x" * 64, ChainKey(root + b"!"), 16)
    # a chunk larger than the text: no key, whatever its size
    assert chain_keys(b"x" * 64, root, 1 << 62) == []


def test_the_chain_is_keyed_by_the_compiled_loop() -> None:
    """The install built ``bus._chaincore`` and the chain uses it (a source tree without
    it fails to import rather than falling back to a slower copy of the loop)."""
    import bus._chaincore
    import bus.prompt_chain

    assert bus.prompt_chain.chain_extend is bus._chaincore.chain_extend
    assert type(bus._chaincore.chain_extend).__name__ == "builtin_function_or_method"
