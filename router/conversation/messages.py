"""A chat completion body to the conversation vLLM hands its chat template.

vLLM does not pass the request's messages to ``apply_chat_template`` as sent: it
validates them against the OpenAI types and rebuilds each one
(``vllm/entrypoints/chat_utils.py``: ``_parse_chat_message_content``,
``_postprocess_messages``), and it assembles the template's keyword arguments from the
request (``ChatCompletionRequest.build_chat_params``, ``OpenAIServing._preprocess_chat``,
``ChatParams``). The engine's prompt is rendered from *that*, so the router renders from
the same thing. The rules, each vLLM's:

Content
  ``None`` is no parts; a string is one text part. Text parts are the types ``text``,
  ``input_text``, ``output_text``, ``refusal`` and ``thinking`` (its ``thinking``
  field), plus bare strings inside the list; a ``text``/``refusal`` part without its
  text is skipped. For a template of content format "string" the texts are joined with
  ``"\\n"`` (so ``None`` content becomes ``""``); for "openai" each becomes a new
  ``{"type": "text", "text": ...}``. A ``tool_reference`` part passes as ``{"type":
  "tool_reference", "name": ...}`` (its name for "string"). Media parts (``image_url``,
  ``input_audio``, ``video_url``, embeddings, ``file``, ...) are :class:`RenderError`
  ``non_text``: their prompt holds model-specific media tokens. A part of an unknown
  type, or without a type, is ``invalid`` (vLLM answers 400).
Messages
  Rebuilt with ``role``, ``content`` and only these keys, in this order: assistant
  ``tool_calls`` (validated as ``{"id", "function": {"arguments", "name"}, "type"}``:
  other keys dropped, as pydantic drops them), assistant ``reasoning`` (copied to
  ``reasoning_content`` too), tool ``tool_call_id``, ``name`` and ``task`` when strings,
  developer ``tools``. A tool message's content parts that are all text are joined with
  ``"\\n"`` even for "openai" templates.
Tool calls
  Each ``arguments`` string is parsed with ``json.loads`` (to whatever it holds; not JSON:
  ``{}``); an empty ``tool_calls`` list is dropped.
Tools
  Each request tool as pydantic dumps it: ``{"type": "function", "function": {"name",
  "description" (null when absent), "parameters" (null when absent), ...extra keys},
  ...extra keys}``.
Template arguments
  ``chat_template_kwargs`` from the body, overridden by the request's own
  ``add_generation_prompt`` (default true), ``continue_final_message`` (default false),
  ``documents`` and ``reasoning_effort`` when those are set, over the defaults ``tools``
  (the request's) and ``tokenize``; values ``None`` and ``"auto"`` never override. A
  request carrying its own ``chat_template`` is ``unsupported`` (vLLM refuses it unless
  started with ``--trust-request-chat-template``, and then the router cannot know it).

Not covered: Mistral models served with ``--tokenizer-mode mistral`` and gpt-oss
(Harmony) do not use a jinja template at all (configure no template for them), nor do
server-side ``--default-chat-template-kwargs`` reach the router.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from xxhash import xxh3_128_digest

from .content_format import ContentFormat
from .errors import RenderError
from .segments import COMMON_CALL, EMPTY, SLOT
from .template import ChatTemplate, CompiledTemplate

__all__ = [
    "AgentSlots",
    "PlainChat",
    "PreparedChat",
    "agent_slots",
    "plain_chat",
    "prepare_chat",
    "prepare_tools",
]

_TEXT_FIELD = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_WHEN_MISSING = frozenset(("text", "refusal"))
_MEDIA_TYPES = frozenset(
    (
        "image_url",
        "input_image",
        "image_embeds",
        "audio_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
        "file",
        "input_file",
    )
)
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_UNSET = (None, "auto")
_KNOBS = frozenset(
    (
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "reasoning_effort",
    )
)
"""The body fields that change what ``prepare_chat`` passes the template."""


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 5x (one per request)
class PreparedChat:
    """What ``apply_chat_template`` receives from vLLM for one request."""

    template: CompiledTemplate
    """The template vLLM picks for this request (``tool_use`` when it has tools)."""
    conversation: list[dict[str, Any]]
    tools: list[Any] | None
    documents: Any
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]
    """The other template variables (``reasoning_effort``, ``enable_thinking``, ...)."""
    plain: tuple[tuple[str, ...], list[str]] | None = None
    """:func:`plain_chat` of the request's messages when vLLM passes them on unchanged
    (content format "string", no developer message): ``conversation`` is then a copy of
    the request's list of messages, the same dicts (nothing to rebuild)."""


_DICT = {dict}
_STR = {str}
_TWO = {2}
_ROLE_FIRST = {"role"}
_role = operator.itemgetter("role")
_content_of = operator.itemgetter("content")


PlainChat = tuple[tuple[str, ...], list[str]]
"""A plain chat's roles and contents (:func:`plain_chat`)."""


def plain_chat(messages: Sequence[Any]) -> PlainChat | None:
    """The roles and contents of ``messages`` when every one is exactly ``{"role": str,
    "content": str}``, keys in that order (the common chat, as vLLM rebuilds it), else
    None: in C-level passes over the list, not a Python loop per message."""
    if not messages:
        return None
    if (
        set(map(type, messages)) != _DICT
        or set(map(len, messages)) != _TWO
        or set(map(next, map(iter, messages))) != _ROLE_FIRST
    ):
        return None
    try:
        roles = tuple(map(_role, messages))
        contents = list(map(_content_of, messages))
    except KeyError:
        return None
    if set(map(type, roles)) != _STR or set(map(type, contents)) != _STR:
        return None
    return roles, contents


def _part(part: Any, wrap: bool) -> Any:
    """One content part as vLLM keeps it: a string, a dict (``wrap``), or None (skipped)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, dict):
        raise RenderError("invalid", f"content part is a {type(part).__name__}, not an object")
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        if any(key in part for key in _MEDIA_KEYS):
            raise RenderError("non_text", "non-text content (media part)")
        if "tool_reference" in part:
            kind = "tool_reference"
        else:
            raise RenderError("invalid", "content part without a 'type'")
    if not isinstance(kind, str):
        raise RenderError("invalid", "content part 'type' is not a string")
    if kind in _MEDIA_TYPES:
        raise RenderError("non_text", f"non-text content ({kind} part)")
    if kind in _TEXT_FIELD:
        text = part.get(_TEXT_FIELD[kind])
        if text is None and kind in _SKIP_WHEN_MISSING:
            return None
        if not isinstance(text, str):
            raise RenderError("invalid", f"{kind} part without a string {_TEXT_FIELD[kind]!r}")
        return {"type": "text", "text": text} if wrap else text
    if kind == "tool_reference":
        name = part.get("name")
        return {"type": "tool_reference", "name": name} if wrap else name
    raise RenderError("invalid", f"unsupported content part type {kind!r}")


def _content(content: Any, fmt: ContentFormat) -> Any:
    if type(content) is str:  # the common case, without the part machinery
        return content if fmt == "string" else [{"type": "text", "text": content}]
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise RenderError("invalid", f"message content is a {type(content).__name__}")
    wrap = fmt == "openai"
    out = [p for p in (_part(p, wrap) for p in parts) if p is not None]
    if wrap:
        return out
    if not all(isinstance(p, str) for p in out):
        raise RenderError("invalid", "tool_reference part without a string name")
    return "\n".join(out)


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RenderError("invalid", "tool_calls is not a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(call.get("id"), str)
            or call.get("type") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise RenderError(
                "invalid", "a tool call needs id, type 'function' and function {name, arguments}"
            )
        out.append(
            {
                "id": call["id"],
                "function": {"arguments": _arguments(fn["arguments"]), "name": fn["name"]},
                "type": "function",
            }
        )
    return out


def _message(msg: Any, fmt: ContentFormat) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise RenderError("invalid", f"a message is a {type(msg).__name__}, not an object")
    role = msg.get("role")
    if not isinstance(role, str):
        raise RenderError("invalid", "a message without a string 'role'")
    out: dict[str, Any] = {"role": role, "content": _content(msg.get("content"), fmt)}
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None:
            checked = _tool_calls(calls)
            if checked:
                out["tool_calls"] = checked
        reasoning = msg.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RenderError("invalid", "assistant 'reasoning' is not a string")
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        parts = out["content"]
        if isinstance(parts, list) and all(p.get("type") == "text" for p in parts):
            out["content"] = "\n".join(p["text"] for p in parts)
    if "name" in msg or "task" in msg:
        for key in ("name", "task"):
            if isinstance(msg.get(key), str):
                out[key] = msg[key]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def prepare_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools`` as vLLM's pydantic model dumps them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RenderError("invalid", "tools is not a list")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(fn, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("description"), str | None)
            or not isinstance(fn.get("parameters"), dict | None)
        ):
            raise RenderError("invalid", "a tool needs type 'function' and function {name, ...}")
        function = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        function.update((k, v) for k, v in fn.items() if k not in function)
        dumped: dict[str, Any] = {"type": "function", "function": function}
        dumped.update((k, v) for k, v in tool.items() if k not in dumped)
        out.append(dumped)
    return out


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RenderError("invalid", f"{name} is not a boolean")
    return value


def prepare_chat(
    body: Mapping[str, Any],
    chat_template: ChatTemplate,
    known: Sequence[dict[str, Any]] = (),
    found_plain: PlainChat | None = None,
) -> PreparedChat:
    """vLLM's template, conversation and template arguments for ``body`` (never mutated);
    ``known``: the prepared messages of a prefix of ``body``'s messages (the render
    cache's, for the same template: they are not prepared again); ``found_plain``: the
    caller's :func:`plain_chat` of ``body``'s messages, when it has one (at 8k tokens the
    passes cost 13-20 us, as much as the key chain's hashing).

    Raises:
        RenderError: media parts, a request vLLM rejects, or a request template.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RenderError("invalid", "messages is not a list")
    if _KNOBS.isdisjoint(body) and not known:
        # the common body: none of the fields below set, so the defaults (what the
        # general path gives for it), and plain messages passed on as they are
        template = chat_template.select(False)
        plain = found_plain
        if plain is None and template.content_format == "string":
            plain = plain_chat(messages)
        if plain is not None and "developer" not in plain[0]:
            return PreparedChat(
                template, list(messages), None, None, True, False, {"tokenize": False}, plain
            )
    if body.get("chat_template") is not None:
        raise RenderError("unsupported", "the request carries its own chat_template")
    ctk = body.get("chat_template_kwargs")
    if ctk is None:
        ctk = {}
    elif not isinstance(ctk, dict):
        raise RenderError("invalid", "chat_template_kwargs is not an object")
    elif ctk.get("chat_template") is not None:
        raise RenderError("unsupported", "chat_template_kwargs carries a chat_template")
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list) and all(isinstance(d, dict) for d in documents)
    ):
        raise RenderError("invalid", "documents is not a list of objects")
    overrides = {
        "add_generation_prompt": _flag(body, "add_generation_prompt", True),
        "continue_final_message": _flag(body, "continue_final_message", False),
        "documents": documents,
        "reasoning_effort": body.get("reasoning_effort"),
    }
    request_kwargs = dict(ctk)
    request_kwargs.update((k, v) for k, v in overrides.items() if v not in _UNSET)
    merged: dict[str, Any] = {"tools": prepare_tools(body.get("tools")), "tokenize": False}
    merged.update((k, v) for k, v in request_kwargs.items() if v not in _UNSET)
    tools = merged.pop("tools", None)
    template = chat_template.select(tools is not None)
    fmt = template.content_format
    plain = plain_chat(messages) if fmt == "string" and not known else None
    if plain is not None and "developer" not in plain[0]:
        # every message is {"role", "content": text}: what vLLM rebuilds is equal to it
        # (and the template cannot change it: the sandbox is immutable)
        return _prepared(template, list(messages), tools, merged, plain)
    conversation = [
        # the common message, {"role", "content": text} and nothing else, rebuilt inline
        # (what _message gives it, without the call)
        {"role": m["role"], "content": m["content"]}
        if type(m) is dict
        and len(m) == 2
        and type(m.get("content")) is str
        and type(m.get("role")) is str
        and fmt == "string"
        and m["role"] != "developer"
        else _message(m, fmt)
        for m in (messages[len(known) :] if known else messages)
    ]
    if known:
        conversation[:0] = known
    return _prepared(template, conversation, tools, merged, None)


def _prepared(
    template: CompiledTemplate,
    conversation: list[dict[str, Any]],
    tools: list[Any] | None,
    merged: dict[str, Any],
    plain: tuple[tuple[str, ...], list[str]] | None,
) -> PreparedChat:
    docs = merged.pop("documents", None)
    agp = merged.pop("add_generation_prompt")
    cfm = merged.pop("continue_final_message")
    return PreparedChat(template, conversation, tools, docs, bool(agp), bool(cfm), merged, plain)


# --- agent loops, straight to the segment renderer's slots -----------------------------


@dataclass(frozen=True, slots=True)
class AgentSlots:
    """An agent-loop request as :meth:`.segments.SegmentRenderer.render_slots` takes it."""

    template: CompiledTemplate
    tools: list[dict[str, Any]] | None
    """As :func:`prepare_tools` gives them."""
    signature: tuple[Any, ...]
    values: list[str]
    """Kept by the readings memo for the conversation's next request: read, never
    changed."""


_TOOL_KEYS = frozenset(("role", "content", "tool_call_id"))
_CALLING_KEYS = frozenset(("role", "content", "tool_calls"))


class _ArgumentsMemo:
    """A tool call's ``arguments`` as sent -> its ``tojson`` text after vLLM's parse (None:
    not an object). An agent loop resends every earlier call each step, so all but the
    newest are found here. First in, first out, within ``max_chars`` characters of both
    texts; strings longer than ``max_raw`` are not kept."""

    __slots__ = ("_chars", "_memo", "max_chars", "max_raw")

    def __init__(self, max_chars: int = 4 << 20, max_raw: int = 1 << 12) -> None:
        self.max_chars = max_chars
        self.max_raw = max_raw
        self._memo: dict[str, str | None] = {}
        self._chars = 0

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def chars(self) -> int:
        return self._chars

    def text(self, raw: str, tojson: Any) -> str | None:
        memo = self._memo
        text = memo.get(raw, _UNSET)
        if text is not _UNSET:
            return text  # type: ignore[return-value]
        parsed = _arguments(raw)
        text = tojson(parsed) if type(parsed) is dict else None
        if len(raw) <= self.max_raw:
            self._chars += len(raw) + len(text or "")
            while memo and self._chars > self.max_chars:
                old_raw = next(iter(memo))
                self._chars -= len(old_raw) + len(memo.pop(old_raw) or "")
            memo[raw] = text
        return text


_ARGUMENTS = _ArgumentsMemo()


class _Reading:
    """What :func:`agent_slots` read of one request's messages, for its next turn."""

    __slots__ = ("cost", "count", "digest", "length", "signature", "tojson", "values")

    def __init__(
        self,
        count: int,
        length: int,
        digest: bytes,
        signature: tuple[Any, ...],
        values: list[str],
        tojson: Any,
        cost: int,
    ) -> None:
        self.count = count
        self.length = length
        self.digest = digest
        self.signature = signature
        self.values = values
        self.tojson = tojson
        self.cost = cost


class _ReadingMemo:
    """A conversation's last reading, so its next turn reads only the messages it adds.

    An agent loop resends its whole history every step: step k+1's messages are step
    k's and a few more. Reading a message is a Python loop's worth of type checks (about
    1 us each: 120 messages at 8k tokens); serializing the list with ``orjson`` is one C
    pass (about 0.2 us a message). The serialization of ``[m0, ..., mn]`` starts with
    that of ``[m0, ..., mk]`` less its closing bracket exactly when the first ``k + 1``
    messages are equal (same keys in the same order, same values): a JSON text's prefix
    fixes where its elements end. So a request whose serialization starts with its
    conversation's last one (XXH3-128 of that prefix, the digest the prompt chain
    itself trusts) reuses that reading and reads only the messages after it.

    The entries keep digests, not messages: message objects kept alive would survive
    into the collector's older generations (measured: a tight loop of new agent loops
    ran 1.6-3x slower with their dicts kept, the same with the collector off). A
    conversation is found by the contents of its first two messages (a system prompt and
    the task; strings only); two conversations sharing both only replace each other's
    entry. Bounded by ``max_cost`` (characters of the values kept plus ``SLOT_COST`` per
    message), least recently used first out."""

    SLOT_COST = 64
    """About what a message's signature tuple and value references cost beyond text."""

    __slots__ = ("_cost", "_memo", "hits", "max_cost", "misses")

    def __init__(self, max_cost: int = 16 << 20) -> None:
        self.max_cost = max_cost
        self._memo: dict[tuple[str, str], _Reading] = {}
        self._cost = 0
        self.hits = 0
        """Readings that reused an earlier turn's."""
        self.misses = 0
        """Readings with no earlier turn to reuse (none kept, or not a prefix)."""

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def cost(self) -> int:
        return self._cost

    @staticmethod
    def key(messages: list[Any]) -> tuple[str, str] | None:
        if len(messages) < 3:
            return None  # nothing before the newest messages worth keeping
        m0, m1 = messages[0], messages[1]
        if type(m0) is not dict or type(m1) is not dict:
            return None
        c0, c1 = m0.get("content"), m1.get("content")
        if type(c0) is not str or type(c1) is not str:
            return None
        return c0, c1

    def find(self, key: tuple[str, str], serialized: bytes, tojson: Any) -> _Reading | None:
        """The last reading of ``key``'s conversation when its messages are the first of
        the ones ``serialized`` (or all of them: the same request again) and were read
        with the same ``tojson``, taken out of the memo."""
        entry = self._memo.pop(key, None)
        if entry is None:
            self.misses += 1
            return None
        self._cost -= entry.cost
        end = entry.length - 1  # without the closing bracket
        if (
            entry.tojson is not tojson
            or len(serialized) < entry.length
            or xxh3_128_digest(memoryview(serialized)[:end]) != entry.digest
        ):
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def keep(self, key: tuple[str, str], entry: _Reading) -> None:
        if entry.cost > self.max_cost:
            return
        memo = self._memo
        old = memo.pop(key, None)
        if old is not None:
            self._cost -= old.cost
        memo[key] = entry
        self._cost += entry.cost
        while self._cost > self.max_cost:
            self._cost -= memo.pop(next(iter(memo))).cost


_READINGS = _ReadingMemo()


def agent_slots(body: Mapping[str, Any], chat_template: ChatTemplate) -> AgentSlots | None:
    """The segment renderer's signature and slot values for a request whose only template
    field is ``tools`` and whose messages are all plain (``{"role", "content": text}``),
    tool results (``{"role": "tool", "content": text, "tool_call_id": text}``) or
    assistant tool calls (``{"role": "assistant", "content": text or null,
    "tool_calls": [...]}``, each call well formed with an object for ``arguments``),
    read in one pass from the request (the messages its conversation's previous request
    had are not read again: :class:`_ReadingMemo`): what :func:`prepare_chat`, then the
    renderer's ``_signature`` of its messages, give for it
    (``tests/unit/test_render_segments.py`` holds them equal), without building vLLM's
    messages. None for anything else (the general path decides, errors included)."""
    if not _KNOBS.isdisjoint(body.keys() - {"tools"}):
        return None
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        return None
    try:
        tools = prepare_tools(body.get("tools"))
    except RenderError:
        return None
    template = chat_template.select(tools is not None)
    segments = template.segments
    if segments is None or template.content_format != "string":
        return None
    tojson = segments.tojson
    key = _ReadingMemo.key(messages)
    serialized = b""
    earlier = None
    if key is not None:
        try:
            serialized = orjson.dumps(messages)
        except TypeError:  # not JSON (a dialect's own objects): read it all, keep nothing
            key = None
        else:
            earlier = _READINGS.find(key, serialized, tojson)
    signature: list[Any]
    if earlier is None:
        signature, values, start, cost = [], [], 0, 0
    else:
        signature = list(earlier.signature)
        values = earlier.values[:]
        start, cost = earlier.count, earlier.cost
    read_from = len(values)
    if not _read(messages, start, signature, values, tojson):
        return None
    slots = AgentSlots(template, tools, tuple(signature), values)
    if key is not None:
        cost += sum(map(len, values[read_from:])) + _ReadingMemo.SLOT_COST * (len(messages) - start)
        digest = xxh3_128_digest(memoryview(serialized)[:-1])
        reading = _Reading(
            len(messages), len(serialized), digest, slots.signature, values, tojson, cost
        )
        _READINGS.keep(key, reading)
    return slots


# A message's part of the signature, one object per kind: the memo keeps signatures, and
# new tuples kept alive would be more for the collector to walk (see _ReadingMemo).
_ROLES = ("system", "user", "assistant", "tool")
_FILLED = {r: (r, SLOT) for r in _ROLES}
_BLANK = {r: (r, EMPTY) for r in _ROLES}
_TOOL_RESULT = {
    (c, t): (
        ("role", "tool"),
        ("content", SLOT if c else EMPTY),
        ("tool_call_id", SLOT if t else EMPTY),
    )
    for c in (False, True)
    for t in (False, True)
}


def _calls_signature(content: Any, calls: int) -> tuple[Any, ...]:
    return (
        ("role", "assistant"),
        ("content", SLOT if content else EMPTY),
        ("tool_calls", (COMMON_CALL,) * calls),
    )


_TOOL_CALLS = {(c, k): _calls_signature(c, k) for c in (False, True) for k in range(1, 9)}


def _read(
    messages: list[Any], start: int, signature: list[Any], values: list[str], tojson: Any
) -> bool:
    """Append the signature and slot values of ``messages[start:]`` (False: a message
    :func:`agent_slots` does not read; the lists are then left part-filled)."""
    add = signature.append
    push = values.append
    for m in messages[start:] if start else messages:
        if type(m) is not dict:
            return False
        role = m.get("role")
        content = m.get("content")
        if type(role) is not str or role == "developer":
            return False
        n = len(m)
        if n == 2 and type(content) is str and "content" in m:
            if content:
                push(content)
                add(_FILLED.get(role) or (role, SLOT))
            else:
                add(_BLANK.get(role) or (role, EMPTY))
        elif n == 3 and role == "tool" and type(content) is str and m.keys() == _TOOL_KEYS:
            tid = m["tool_call_id"]
            if type(tid) is not str:
                return False
            if content:
                push(content)
            if tid:
                push(tid)
            add(_TOOL_RESULT[bool(content), bool(tid)])
        elif (
            n == 3
            and role == "assistant"
            and (content is None or type(content) is str)
            and m.keys() == _CALLING_KEYS
        ):
            calls = m["tool_calls"]
            if type(calls) is not list or not calls:
                return False
            if content:
                push(content)
            for call in calls:
                fn = call.get("function") if type(call) is dict else None
                if type(fn) is not dict or call.get("type") != "function":
                    return False
                cid, name, raw = call.get("id"), fn.get("name"), fn.get("arguments")
                if type(cid) is not str or type(name) is not str or type(raw) is not str:
                    return False
                if not cid or not name:
                    return False
                text = _ARGUMENTS.text(raw, tojson)
                if text is None:
                    return False
                values += (cid, text, name)
            add(
                _TOOL_CALLS.get((bool(content), len(calls)))
                or _calls_signature(content, len(calls))
            )
        else:
            return False
    return True
