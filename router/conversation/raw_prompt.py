"""The special tokens an engine's tokenizer puts before a raw prompt.

``/v1/completions`` sends a prompt the engine tokenizes as it is, with no chat template,
but with the tokenizer's special tokens: vLLM and SGLang encode a completion prompt with
``add_special_tokens=True``, so a Llama 3, Mistral or Gemma engine caches
``<|begin_of_text|>`` / ``<s>`` / ``<bos>`` + the prompt, and the listener (which turns
tokens back into bytes, special tokens as their text) announces keys over those bytes.
The router must key the same bytes, or no completion chain of such a model ever matches.
(A chat request needs none of this: its template writes the BOS itself and the engine
encodes the rendered text without special tokens.)

Where the prefix comes from, as HF ``tokenizers`` / ``transformers`` apply it:

* ``tokenizer.json``'s ``post_processor``: ``TemplateProcessing`` (its ``single``
  template's ``SpecialToken`` items before the ``Sequence``), ``BertProcessing`` /
  ``RobertaProcessing`` (their ``cls`` token), or a ``Sequence`` of processors (each one
  in order). ``ByteLevel`` (Qwen2, GPT-2) and ``null`` add nothing.
* ``tokenizer_config.json``'s ``add_bos_token``: ``transformers`` rebuilds the Llama-style
  post processor from it, so an explicit ``false`` means no BOS whatever
  ``tokenizer.json`` says, and an explicit ``true`` with no post processor that adds it
  means ``bos_token``.

Only the prefix matters: a suffix (an EOS some tokenizers append) falls after the
prompt's last full chunk, which is never announced as held.
"""

from __future__ import annotations

from typing import Any

__all__ = ["raw_prompt_prefix"]


def _processor_prefix(proc: Any) -> str:
    if not isinstance(proc, dict):
        return ""
    kind = proc.get("type")
    if kind == "Sequence":
        return "".join(_processor_prefix(p) for p in proc.get("processors") or ())
    if kind == "TemplateProcessing":
        out: list[str] = []
        for item in proc.get("single") or ():
            if not isinstance(item, dict):
                break
            special = item.get("SpecialToken")
            if not isinstance(special, dict):
                break  # the Sequence: what follows is a suffix
            token = special.get("id")
            if isinstance(token, str):
                out.append(token)
        return "".join(out)
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls = proc.get("cls")
        if isinstance(cls, list) and cls and isinstance(cls[0], str):
            return cls[0]
    return ""


def raw_prompt_prefix(tokenizer_json: Any, tokenizer_config: Any, bos_token: str | None) -> str:
    """The text the engine's tokenizer adds before a raw prompt ("" when nothing).

    Args:
        tokenizer_json: the parsed ``tokenizer.json``, or None when not configured.
        tokenizer_config: the parsed ``tokenizer_config.json``, or None.
        bos_token: the config's ``bos_token`` text, when it names one.
    """
    add_bos = tokenizer_config.get("add_bos_token") if isinstance(tokenizer_config, dict) else None
    post = tokenizer_json.get("post_processor") if isinstance(tokenizer_json, dict) else None
    prefix = _processor_prefix(post)
    if add_bos is False and bos_token and prefix.startswith(bos_token):
        return prefix[len(bos_token) :]
    if add_bos is True and bos_token and not prefix.startswith(bos_token):
        return bos_token + prefix
    return prefix
