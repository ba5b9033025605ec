"""The tokenizer's normalizer and the request chain: the keys are ``bus.prompt_chain``'s
over the normalized UTF-8 prompt, rooted at (base model, caller's salt, LoRA adapter)."""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import normalizers

from bus.prompt_chain import chain_keys, chain_root
from router.config.models import ChatTemplateConfig
from router.conversation import ChatTemplate, ConversationKeys, load_chat_template, render_prompt
from router.conversation.normalizer import Normalizer, UnsupportedNormalizer

from .conversation_support import MISTRAL_CONFIG, MISTRAL_JINJA, qwen_dir

QWEN = qwen_dir()

# --- normalizer -----------------------------------------------------------------------

_assigned = st.text(
    st.characters(codec="utf-8").filter(lambda c: unicodedata.category(c) != "Cn"), max_size=40
)
_HF = {
    "NFC": normalizers.NFC,
    "NFD": normalizers.NFD,
    "NFKC": normalizers.NFKC,
    "NFKD": normalizers.NFKD,
    "Lowercase": normalizers.Lowercase,
}


@settings(max_examples=300, deadline=None)
@given(text=_assigned, kinds=st.lists(st.sampled_from(sorted(_HF)), min_size=1, max_size=3))
def test_normalizers_match_the_tokenizers_library(text: str, kinds: list[str]) -> None:
    spec = {"type": "Sequence", "normalizers": [{"type": k} for k in kinds]}
    theirs = normalizers.Sequence([_HF[k]() for k in kinds]).normalize_str(text)
    assert Normalizer(spec)(text) == theirs


def test_an_already_normalized_prompt_is_returned_as_is() -> None:
    text = "<|im_start|>user\ncafé 日本<|im_end|>\n" * 1000
    assert Normalizer({"type": "NFC"})(text) is text


def test_text_between_protected_tokens_is_normalized_apart() -> None:
    n = Normalizer(
        {"type": "Sequence", "normalizers": [{"type": "Lowercase"}, {"type": "NFC"}]},
        protected=["[INST]", "TOKa"],
    )
    assert n("[INST]ÀB e\u0301") == "[INST]àb é"
    # NFC never composes across a protected token: "a" + combining acute stay apart
    assert n("TOKa\u0301") == "TOKa\u0301"


@pytest.mark.parametrize("kind", ["Replace", "Prepend", "Strip", "BertNormalizer", "Precompiled"])
def test_unsupported_normalizers_are_refused_by_name(kind: str) -> None:
    with pytest.raises(UnsupportedNormalizer, match=repr(kind)):
        Normalizer({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": kind}]})


def test_qwen_tokenizer_json_gives_nfc_with_special_tokens_protected() -> None:
    t = load_chat_template(str(QWEN / "tokenizer_config.json"), None, str(QWEN / "tokenizer.json"))
    assert t.normalizer.description == "NFC"
    assert t.normalizer("e\u0301<|im_end|>") == "é<|im_end|>"


# --- the chain ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return load_chat_template(
        str(QWEN / "tokenizer_config.json"), None, str(QWEN / "tokenizer.json")
    )


@pytest.fixture
def keys(qwen: ChatTemplate) -> ConversationKeys:
    mistral = load_chat_template(str(MISTRAL_CONFIG), str(MISTRAL_JINJA), None)
    return ConversationKeys(
        {"qwen": qwen, "mistral": mistral}, chunk_bytes=64, lora_adapters={"qwen-sql": "qwen"}
    )


def _body(**kw: Any) -> dict[str, Any]:
    msgs = [
        {"role": "system", "content": "S" * 100},
        {"role": "user", "content": "cafe\u0301 " * 30},
    ]
    return {"model": "qwen", "messages": msgs, **kw}


def test_the_chain_is_the_prompt_chain_of_the_normalized_prompt(
    keys: ConversationKeys, qwen: ChatTemplate
) -> None:
    body = _body()
    chain = keys.chain(body)
    assert chain is not None
    text = unicodedata.normalize("NFC", render_prompt(qwen, body)).encode()
    assert chain.prompt_bytes == len(text)
    assert chain.keys == chain_keys(text, chain_root("qwen", None, None), 64)
    assert len(chain.keys) == len(text) // 64
    assert (chain.model, chain.lora) == ("qwen", None)


def test_roots_separate_salts_and_adapters(keys: ConversationKeys, qwen: ChatTemplate) -> None:
    text = unicodedata.normalize("NFC", render_prompt(qwen, _body())).encode()
    salted = keys.chain(_body(cache_salt="tenant-1"))
    adapter = keys.chain(_body(model="qwen-sql"))
    assert salted is not None and adapter is not None
    assert salted.keys == chain_keys(text, chain_root("qwen", "tenant-1", None), 64)
    assert adapter.keys == chain_keys(text, chain_root("qwen", None, "qwen-sql"), 64)
    assert (adapter.model, adapter.lora) == ("qwen", "qwen-sql")
    assert keys.has_template("qwen-sql") and not keys.has_template("llama")


def test_a_shared_prefix_shares_its_keys(keys: ConversationKeys) -> None:
    turn1 = keys.chain(_body())
    body2 = _body()
    body2["messages"] = [
        *body2["messages"],
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "next " * 40},
    ]
    turn2 = keys.chain(body2)
    assert turn1 is not None and turn2 is not None
    # everything up to the generation prompt is a prefix of the next turn's prompt
    shared = len(turn1.keys) - 1
    assert turn2.keys[:shared] == turn1.keys[:shared]
    assert len(turn2.keys) > len(turn1.keys)


def test_failures_are_counted_per_model_and_reason_and_logged_once(
    keys: ConversationKeys, caplog: pytest.LogCaptureFixture
) -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
    caplog.set_level(logging.WARNING, "continuum.conversation")
    for _ in range(3):
        assert keys.chain({"model": "qwen", "messages": [image]}) is None
    assert (
        keys.chain({"model": "mistral", "messages": [{"role": "critic", "content": "x"}]}) is None
    )
    assert keys.chain({"model": "qwen", "messages": [], "cache_salt": 5}) is None
    assert keys.chain({"model": "llama", "messages": []}) is None
    assert keys.chain({"messages": []}) is None
    stats = keys.stats()
    assert stats["failures"] == {"qwen": {"invalid": 1, "non_text": 3}, "mistral": {"template": 1}}
    assert stats["no_template"] == 1 and stats["rendered"] == {}
    assert [r.getMessage().count("non_text") for r in caplog.records].count(1) == 1
    assert len(caplog.records) == 3


def test_from_specs_loads_every_template_and_adapter() -> None:
    spec = ChatTemplateConfig(
        model="qwen",
        tokenizer_config=str(QWEN / "tokenizer_config.json"),
        tokenizer=str(QWEN / "tokenizer.json"),
        lora_adapters=["a1", "a2"],
    )
    keys = ConversationKeys.from_specs([spec], chunk_bytes=1024)
    assert keys.stats()["models"] == ["a1", "a2", "qwen"]
    chain = keys.chain({"model": "a2", "messages": [{"role": "user", "content": "x" * 3000}]})
    assert chain is not None and chain.lora == "a2" and len(chain.keys) == 2
