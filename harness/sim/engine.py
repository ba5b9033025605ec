"""Simulated LLM inference engine speaking the OpenAI and Anthropic wire formats.

It exists so router tests, benchmarks and the demo can run a whole fleet on a laptop: the
official SDKs must accept its answers unmodified, the prefix-cache model must make routing
decisions visible (``x-sim-cached-tokens``, ``/sim/stats``), and faults must be injectable per
request without restarting anything.

Output is deterministic: ``"[<name>] echo: <first 40 chars of the last user message>"``,
padded with filler words up to ``max_tokens`` (capped at ``max_words``). One word is one
completion token and one streamed chunk, so usage numbers and stream lengths agree. A
request with ``tools`` and ``tool_choice`` ``"required"`` (or a named function) is answered
with one tool call instead (``finish_reason: "tool_calls"``): the named function, or one of
the tools picked by a hash of the last message, with ``{"query": <its first 40 chars>}``.

The prefix cache sees the prompt's tokens at prefill and the answer's as decode fills its
blocks (on by default with ``qwen2``: the answer as the template renders it in the next
turn's history, so a conversation's next turn hits it; ``--cache-output`` /
``--no-cache-output`` override). ``usage.prompt_tokens_details.cached_tokens`` (also in the
last chunk of a stream with ``stream_options.include_usage``) is the prefill's cache hit.
With ``latency``, prefill sleeps its modelled time and decode ``decode_us_per_token`` per
generated token.

Engine-side features for the KV-event listener (all off by default):

* ``tokenizer="qwen2"``: real Qwen2 BPE, prompts rendered by the model's own chat template
  through jinja2 as vLLM does (:mod:`harness.sim.tokenizer`, :mod:`harness.sim.chat_template`);
  ``POST /detokenize`` and ``/v1/detokenize`` answer vLLM's ``{"prompt": text}`` (or
  SGLang's ``{"text": ...}`` with ``detokenize_format="sglang"``) with either tokenizer.
* ``cache_salt`` (OpenAI body field, as vLLM; honoured on /v1/messages too): folded into the
  first block's hash and shown in the KV events.
* KV events over ZMQ (vLLM/SGLang formats, replay) and trtllm's ``POST /kv_cache_events``
  (:mod:`harness.sim.kv_events`); ``POST /reset_prefix_cache`` (vLLM), ``/flush_cache``
  (SGLang) and ``/sim/reset`` send ``AllBlocksCleared``; ``POST /sim/burst`` publishes
  synthetic batches for ingestion benchmarks.

``GET /sim/held-prefixes`` is the fault tests' oracle (:mod:`harness.sim.held`): the router
prefix keys of the requests served, those whose blocks are still cached, computed with the
router's own key function; ``GET /sim/held-conversation`` the same for conversation keys
(``--conversation-chunk-bytes``, the router's ``chunk_bytes``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import struct
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from bus.prefix_key import compute_prefix_key
from bus.prompt_chain import DEFAULT_CHUNK_BYTES

from . import completions as text_api
from . import responses as responses_api
from .block_types import request_features, token_types
from .chat_template import ChatTemplateError, anthropic_to_openai
from .held import HeldConversation, HeldPrefixes
from .httpserver import (
    JSONDecodeError,
    Request,
    Response,
    StreamResponse,
    dumps,
    json_response,
    loads,
)
from .kv_events import KvEventPublisher, TrtllmQueue, ZmqPublisher, offset_endpoint
from .kv_wire import get_format
from .prefix_cache import BlockSequence, KVEventCallback, PrefixCache, StoredBlock
from .prompt import content_text
from .prompt import render_anthropic_prompt as render_anthropic_prompt  # re-export
from .prompt import render_chat_prompt as render_chat_prompt  # re-export
from .tokenizer import DecodeError, make_tokenizer

__all__ = ["SimConfig", "SimEngine"]

_FILLER = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua"
).split()
_MAX_EMBED_DIMS = 4096
_TRUTHY = frozenset({"1", "true", "yes", "on"})
_FAULT_HEADERS = ("x-sim-delay-ms", "x-sim-status", "x-sim-garbage")
_UTILITY_PATHS = frozenset(
    {"/detokenize", "/v1/detokenize", "/reset_prefix_cache", "/flush_cache", "/kv_cache_events"}
)
_MAX_BURST_BATCHES = 100_000_000

_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass
class SimConfig:
    """Engine settings; mirrors the CLI flags of ``python -m harness.sim``."""

    name: str = "sim-1"
    models: tuple[str, ...] = ("demo-model",)
    block_size: int = 16
    capacity_blocks: int = 4096
    prefill_us_per_token: float = 50.0
    prefill_overhead_us: float = 1000.0
    #: Modelled decode time per generated token (slept only with ``latency``).
    decode_us_per_token: float = 0.0
    #: Actually sleep the modelled prefill/decode time (off: benchmarks measure the router).
    latency: bool = False
    #: Fixed chat answer without touching the cache: the "trivial backend" for proxy benches.
    trivial: bool = False
    unhealthy: bool = False
    #: 404 for models not in ``models`` (vLLM behaviour); off by default so tests can use any.
    strict_models: bool = False
    max_words: int = 64
    #: ``simple`` (fast crc32 words, the sim's own prompt layout) or ``qwen2`` (BPE and the
    #: model's chat template).
    tokenizer: str = "simple"
    #: A ``tokenizer.json`` to use instead of the bundled Qwen2 one (``qwen2`` only).
    tokenizer_file: str | None = None
    #: The ``tokenizer_config.json`` with the chat template (default: beside the tokenizer).
    tokenizer_config: str | None = None
    #: Cache the blocks of generated tokens too (None: on with ``qwen2``, off with ``simple``).
    cache_output: bool | None = None
    #: ``/detokenize`` answer shape: ``vllm`` (``{"prompt"}``) or ``sglang`` (``{"text"}``).
    detokenize_format: str = "vllm"
    #: ZMQ PUB endpoint for KV events (None: off); bind/connect as the engines decide.
    kv_events: str | None = None
    kv_events_topic: str = ""
    #: Wire format of one engine release, see ``harness.sim.kv_wire.FORMATS``.
    kv_events_format: str = "vllm-0.33"
    #: ZMQ ROUTER replay endpoint (always binds); None: no replay.
    kv_events_replay: str | None = None
    #: Batches kept for replay (vLLM's ``buffer_steps``).
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000
    #: Synthetic batches to burst once the first subscriber connected (0: none).
    kv_events_burst: int = 0
    kv_events_burst_events: int = 8
    #: Data-parallel rank: offsets the TCP ports and is the batches' dp_rank.
    dp_rank: int | None = None
    #: vLLM ≥0.10.2 hash type on the wire: ``u64`` (default) or ``bytes`` (32-byte digest).
    hash_format: str = "u64"
    #: Serve trtllm-serve's ``POST /kv_cache_events``.
    kv_events_trtllm: bool = False
    #: An idle trtllm poll waits this long for an event before answering ``[]`` (0: at once).
    trtllm_poll_block_ms: int = 0
    trtllm_window_size: int = 4096
    trtllm_max_events: int = 10_000
    #: gRPC ``host:port`` of a listener's EvictionAdvisor: evict in its order, not LRU's.
    eviction_advisor: str | None = None
    #: Bytes per conversation key of the oracle (``GET /sim/held-conversation``); the
    #: router's and the listener's ``conversation.chunk_bytes``.
    conversation_chunk_bytes: int = DEFAULT_CHUNK_BYTES


class ApiError(Exception):
    """Raised by handlers; rendered in the error dialect of the endpoint that was called."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _SimulatedAbort(Exception):
    """Raised inside a stream to make the server cut the connection mid-body."""


def _int_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _has_cache_control(obj: Any) -> bool:
    if isinstance(obj, dict):
        return "cache_control" in obj or any(_has_cache_control(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_cache_control(v) for v in obj)
    return False


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message must be an object with a string 'role'")
    return messages


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def _token_list(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return None
    return value


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return content_text(m.get("content"))
    return ""


def embed(text: str, dims: int = 8) -> list[float]:
    """Deterministic unit vector; values are float32-exact so float and base64 formats agree."""
    raw = hashlib.shake_128(text.encode("utf-8", "surrogatepass")).digest(4 * dims)
    vals = [x / 2147483648.0 - 1.0 for x in struct.unpack(f"<{dims}I", raw)]
    norm = sum(v * v for v in vals) ** 0.5 or 1.0
    return list(array("f", [v / norm for v in vals]))


@dataclass
class _Answer:
    words: list[str]
    truncated: bool

    def pieces(self) -> list[str]:
        return [w if i == 0 else f" {w}" for i, w in enumerate(self.words)]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class _Reply:
    """The answer as the response carries it (``message``) and as the cache sees it."""

    answer: _Answer
    message: dict[str, Any]
    #: Token ids computed for the reply (prompt excluded, end-of-turn token excluded).
    token_ids: list[int] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        calls = self.message.get("tool_calls")
        return calls if isinstance(calls, list) else None

    @property
    def completion_tokens(self) -> int:
        if self.tool_calls is not None:
            return len(self.token_ids) + 1 if self.token_ids else 1
        return len(self.answer.words)


class _Decoder:
    """Generates a reply's tokens: sleeps the modelled decode time and caches each block
    of the sequence as it fills (vLLM stores a running request's full blocks every step)."""

    def __init__(self, engine: SimEngine, seq: BlockSequence | None, generated: int) -> None:
        self.engine = engine
        self.seq = seq
        self.generated = generated
        self.done = 0
        bs = engine.cache.block_size
        self._prompt = seq.prompt_tokens if seq is not None else 0
        self._blocks = self._prompt // bs

    async def advance(self, n: int) -> None:
        """``n`` more tokens generated (clamped to the reply's length)."""
        n = max(0, min(n, self.generated - self.done))
        cfg = self.engine.config
        if n and cfg.latency and cfg.decode_us_per_token > 0:
            await asyncio.sleep(n * cfg.decode_us_per_token / 1e6)
        self.done += n
        seq = self.seq
        if seq is None:
            return
        blocks = (self._prompt + self.done) // self.engine.cache.block_size
        if blocks > self._blocks:
            self._blocks = blocks
            self.engine._commit(seq, self._prompt + self.done)

    async def run(self) -> None:
        """The whole reply, one cache update (one engine step's batch) per filled block."""
        bs = self.engine.cache.block_size
        while self.done < self.generated:
            to_boundary = bs - (self._prompt + self.done) % bs
            await self.advance(to_boundary)

    async def share(self, i: int, pieces: int) -> None:
        """Advance to piece ``i + 1`` of ``pieces`` streamed chunks (evenly spread)."""
        await self.advance(self.generated * (i + 1) // max(1, pieces) - self.done)


def _called_tool(tools: Any, choice: Any, messages: list[dict[str, Any]]) -> str | None:
    """The function a forced tool choice calls (None: answer in text)."""
    if not isinstance(tools, list) or not tools:
        return None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        return name if isinstance(name, str) else None
    if choice != "required":
        return None
    names = [
        t["function"]["name"]
        for t in tools
        if isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
    ]
    if not names:
        return None
    last = content_text(messages[-1].get("content")).encode("utf-8", "surrogatepass")
    return names[zlib.crc32(last) % len(names)]


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object")
    return kwargs


@dataclass
class SimEngine:
    """The request handler for :func:`harness.sim.httpserver.serve`; holds all engine state."""

    config: SimConfig = field(default_factory=SimConfig)
    #: Forwarded to the prefix cache; later turned into vLLM KV events.
    on_kv_event: KVEventCallback | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        if not cfg.models:
            raise ValueError("at least one model is required")
        if cfg.detokenize_format not in ("vllm", "sglang"):
            raise ValueError("detokenize_format must be 'vllm' or 'sglang'")
        if cfg.dp_rank is not None and cfg.dp_rank < 0:
            raise ValueError("dp_rank must be >= 0")
        if cfg.hash_format not in ("u64", "bytes"):
            raise ValueError("hash_format must be 'u64' or 'bytes'")
        self.tokenizer = make_tokenizer(cfg.tokenizer, cfg.tokenizer_file, cfg.tokenizer_config)
        self.cache_output = (
            cfg.cache_output if cfg.cache_output is not None else cfg.tokenizer != "simple"
        )
        self.kv = self._build_kv_hub()
        self._salt: str | None = None
        self._clearing: list[Any] | None = None
        self.advisor: Any = None
        if cfg.eviction_advisor:
            from harness.sim.advisor_client import AdvisedEviction

            self.advisor = AdvisedEviction(cfg.eviction_advisor, cfg.name)
        hooked = self.on_kv_event is not None or self.kv is not None or self.advisor is not None
        self.cache = PrefixCache(
            block_size=cfg.block_size,
            capacity_blocks=cfg.capacity_blocks,
            prefill_us_per_token=cfg.prefill_us_per_token,
            prefill_overhead_us=cfg.prefill_overhead_us,
            on_change=self._on_cache_change if hooked else None,
            hasher=self.kv.hasher if self.kv is not None else None,
        )
        if self.advisor is not None:
            self.advisor.attach(self.cache)
        self.held = HeldPrefixes(self.cache, cfg.capacity_blocks)
        self.held_conversation = HeldConversation(
            self.cache, cfg.capacity_blocks, chunk_bytes=cfg.conversation_chunk_bytes
        )
        self.requests = 0
        self.errors = 0
        self.in_flight = 0
        self.started = int(time.time())
        self._last: Request | None = None
        self._id_prefix = os.urandom(4).hex()
        self._seq = itertools.count(1)
        self._headers = {"x-sim-backend": cfg.name}
        #: Stored responses (``previous_response_id``): id -> conversation, oldest first.
        self.stored_responses: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._routes: dict[tuple[str, str], Callable[[Request], Awaitable[Any]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/messages"): self._messages,
            ("POST", "/v1/messages/count_tokens"): self._count_tokens,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self._responses,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/sim/stats"): self._stats,
            ("POST", "/sim/reset"): self._reset,
            ("GET", "/sim/last-request"): self._last_request,
            ("GET", "/sim/last-headers"): self._last_headers,
            ("POST", "/sim/burst"): self._burst,
            ("GET", "/sim/held-prefixes"): self._held_prefixes,
            ("GET", "/sim/held-conversation"): self._held_conversation,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/v1/detokenize"): self._detokenize,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/flush_cache"): self._flush_cache,
            ("GET", "/flush_cache"): self._flush_cache,
        }
        if self.kv is not None and self.kv.trtllm is not None:
            self._routes[("POST", "/kv_cache_events")] = self._kv_cache_events
        self._paths = {path for _, path in self._routes}
        self._trivial_bodies = {m: self._build_trivial(m) for m in cfg.models}

    def _build_kv_hub(self) -> KvEventPublisher | None:
        cfg = self.config
        if cfg.kv_events is None and not cfg.kv_events_trtllm:
            if cfg.kv_events_replay is not None or cfg.kv_events_burst:
                raise ValueError("--kv-events-replay/--kv-events-burst need --kv-events")
            return None
        if cfg.block_size < 1:
            raise ValueError("block_size must be >= 1")
        fmt = get_format(cfg.kv_events_format) if cfg.kv_events is not None else None
        publisher = None
        if cfg.kv_events is not None and fmt is not None:
            replay = cfg.kv_events_replay
            publisher = ZmqPublisher(
                offset_endpoint(cfg.kv_events, cfg.dp_rank),
                topic=cfg.kv_events_topic,
                replay_endpoint=None if replay is None else offset_endpoint(replay, cfg.dp_rank),
                buffer_steps=cfg.kv_events_buffer_steps,
                hwm=cfg.kv_events_hwm,
                replay_topic=fmt.replay_topic,
            )
        elif cfg.kv_events_replay is not None or cfg.kv_events_burst:
            raise ValueError("--kv-events-replay/--kv-events-burst need --kv-events")
        trtllm = None
        if cfg.kv_events_trtllm:
            trtllm = TrtllmQueue(
                cfg.capacity_blocks,
                window_size=cfg.trtllm_window_size,
                dp_rank=cfg.dp_rank,
                max_events=cfg.trtllm_max_events,
                poll_block_s=max(0, cfg.trtllm_poll_block_ms) / 1000,
            )
        return KvEventPublisher(
            block_size=cfg.block_size,
            fmt=fmt,
            hash_format=cfg.hash_format,
            publisher=publisher,
            trtllm=trtllm,
            dp_rank=cfg.dp_rank,
            sample_ids=self.tokenizer.sample_ids,
        )

    async def start(self) -> None:
        """Open the KV-event sockets (needs the running loop); a no-op without KV events."""
        if self.kv is not None:
            self.kv.start(self.config.kv_events_burst, self.config.kv_events_burst_events)

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
        if self.advisor is not None:
            self.advisor.close()

    def _on_cache_change(self, stored: list[StoredBlock], removed: list[Any]) -> None:
        if self.on_kv_event is not None:
            self.on_kv_event(stored, removed)
        if self.advisor is not None:
            self.advisor.changed(stored, removed)
        if self._clearing is not None:
            self._clearing.extend(removed)
        elif self.kv is not None:
            self.kv.changed(stored, removed, self.cache.last_removed_parents, self._salt)

    def _clear_cache(self) -> None:
        """Drop every cached block; KV events report it as one ``AllBlocksCleared``."""
        self._clearing = []
        try:
            self.cache.clear()
            removed = self._clearing
        finally:
            self._clearing = None
        if self.kv is not None:
            self.kv.cleared(removed)

    # -- dispatch ---------------------------------------------------------------------------

    async def __call__(self, req: Request) -> Response | StreamResponse:
        anthropic = req.path.startswith("/v1/messages")
        route = self._routes.get((req.method, req.path))
        if route is None:
            if req.path in self._paths:
                return self._error(405, f"method {req.method} not allowed", anthropic)
            return self._error(404, f"no route for {req.method} {req.path}", anthropic)
        if req.path.startswith("/sim/"):
            # Control plane: never faulted, counted or recorded, so tests can observe freely.
            result: Response | StreamResponse = await route(req)
            return result
        # Engine utility endpoints (detokenize, cache reset, trtllm's event poll) can be
        # faulted but are not inference: not counted, not recorded as the last request.
        inference = req.method == "POST" and req.path not in _UTILITY_PATHS
        if inference:
            self.requests += 1
            self._last = req
            self.in_flight += 1
        try:
            h = req.headers
            if h and any(k in h for k in _FAULT_HEADERS):
                fault = await self._inject_fault(req, anthropic)
                if fault is not None:
                    return fault
            result = await route(req)
            return result
        except ApiError as e:
            self.errors += 1
            return self._error(e.status, e.message, anthropic)
        finally:
            if inference:
                self.in_flight -= 1

    async def _inject_fault(self, req: Request, anthropic: bool) -> Response | None:
        h = req.headers
        delay = _int_header(h.get("x-sim-delay-ms"))
        if delay and delay > 0:
            await asyncio.sleep(delay / 1000)
        status = _int_header(h.get("x-sim-status"))
        if status is not None and 400 <= status <= 599:
            self.errors += 1
            return self._error(status, f"simulated failure (x-sim-status: {status})", anthropic)
        if h.get("x-sim-garbage", "").strip().lower() in _TRUTHY:
            self.errors += 1
            return Response(b"not json at all", 200, self._headers)
        return None

    def _error(self, status: int, message: str, anthropic: bool) -> Response:
        if anthropic:
            kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
            body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
        else:
            kind = _OPENAI_ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            )
            body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return json_response(body, status, self._headers)

    # -- request helpers --------------------------------------------------------------------

    def _json_body(self, req: Request) -> dict[str, Any]:
        try:
            body = loads(req.body)
        except JSONDecodeError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any], required: bool = False) -> str:
        model = body.get("model")
        if model is None and not required:
            return self.config.models[0]
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' must be a non-empty string")
        if self.config.strict_models and model not in self.config.models:
            raise ApiError(404, f"The model `{model}` does not exist.")
        return model

    def _max_tokens(self, body: dict[str, Any], *keys: str, required: bool = False) -> int | None:
        for key in keys:
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(400, f"'{key}' must be a positive integer")
            return value
        if required:
            raise ApiError(400, f"{keys[0]}: Field required")
        return None

    def _answer(self, last_user: str, max_tokens: int | None) -> _Answer:
        snippet = " ".join(last_user[:40].split())
        words = f"[{self.config.name}] echo: {snippet}".split()
        if max_tokens is None:
            return _Answer(words, False)
        target = min(max_tokens, self.config.max_words)
        truncated = max_tokens < len(words)
        if len(words) >= target:
            return _Answer(words[:target], truncated)
        filler = itertools.islice(itertools.cycle(_FILLER), target - len(words))
        return _Answer(words + list(filler), truncated)

    def _reply(
        self,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        max_tokens: int | None,
        prompt: str,
        tools: Any = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> _Reply:
        """The assistant message this request is answered with (text or one tool call),
        with the token ids the engine computes for it when the cache keeps outputs."""
        name = _called_tool(tools, body.get("tool_choice"), messages)
        if name is not None:
            snippet = " ".join(content_text(messages[-1].get("content"))[:40].split())
            call = {
                "id": self._next_id("call_"),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps({"query": snippet})},
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            reply = _Reply(_Answer([], False), message)
        else:
            answer = self._answer(_last_user_text(messages), max_tokens)
            reply = _Reply(answer, {"role": "assistant", "content": answer.text})
        if self.cache_output:
            reply.token_ids = self.tokenizer.reply_tokens(
                prompt, messages, tools, reply.message, template_kwargs
            )
        return reply

    def _typed(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict[str, Any] | None,
        prompt: str,
    ) -> list[int]:
        """The token type of each prompt token, from the chat template (``block_types``)."""
        tok = self.tokenizer
        return token_types(
            lambda msgs: tok.render_chat(msgs, tools, kwargs),
            tok.encode,
            messages,
            tok.encode(prompt),
            bool(tools),
        )

    def _prefill(
        self,
        prompt: str,
        salt: str | None = None,
        session: str | None = None,
        reply: _Reply | None = None,
        key: bytes | None = None,
        model: str | None = None,
        ids: list[int] | None = None,
    ) -> tuple[int, int, int, _Decoder]:
        """Run the cache model on the prompt (or its token ``ids``, as given); returns
        (cached, total, newly stored tokens) and the decoder that caches ``reply``'s tokens
        as they are generated. The sequence's blocks are recorded under the request's
        prefix ``key`` and, for a request of ``model``, under its conversation keys (the
        oracles)."""
        tokens = ids if ids is not None else self.tokenizer.encode(prompt)
        out = reply.token_ids if reply is not None and self.cache_output else []
        full = self.cache.sequence([*tokens, *out], salt, len(tokens))
        seq = full if out else None
        self._salt = salt
        try:
            cached, total = self.cache.prefill(full)
        finally:
            self._salt = None
        self.held.served(key, full.hashes)
        if model is not None:
            pieces = self.tokenizer.token_bytes(full.tokens)
            bs = self.cache.block_size
            self.held_conversation.served(model, salt, pieces, bs, full.hashes)
        if self.advisor is not None:
            self.advisor.prefilled(tokens, salt, cached, session)
        return cached, total, self.cache.last_stored_tokens, _Decoder(self, seq, len(out))

    def _commit(self, seq: BlockSequence, computed: int) -> None:
        self._salt = seq.salt  # shown on a first block stored again after an eviction
        try:
            self.cache.commit(seq, computed)
        finally:
            self._salt = None

    async def _model_latency(self, uncached: int) -> None:
        if self.config.latency:
            await asyncio.sleep(self.cache.prefill_seconds(uncached))

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{self._id_prefix}{next(self._seq):08x}"

    def _sim_headers(self, cached: int, total: int) -> dict[str, str]:
        return {
            "x-sim-backend": self.config.name,
            "x-sim-cached-tokens": str(cached),
            "x-sim-prompt-tokens": str(total),
        }

    @staticmethod
    def _stream_knobs(req: Request) -> tuple[float, int | None]:
        delay = _int_header(req.headers.get("x-sim-stream-delay-ms")) or 0
        abort_after = _int_header(req.headers.get("x-sim-stream-abort-after"))
        return max(0, delay) / 1000, abort_after

    # -- OpenAI chat ------------------------------------------------------------------------

    def _build_trivial(self, model: str) -> bytes:
        return dumps(
            {
                "id": "chatcmpl-trivial",
                "object": "chat.completion",
                "created": self.started,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "total_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }
        )

    async def _chat(self, req: Request) -> Response | StreamResponse:
        body = self._json_body(req)
        if self.config.trivial:
            return self._trivial_chat(req, body)
        messages = _checked_messages(body.get("messages"))
        model = self._model(body)
        max_tokens = self._max_tokens(body, "max_completion_tokens", "max_tokens")
        salt = _cache_salt(body)
        tools = body.get("tools")
        kwargs = _template_kwargs(body)
        try:
            prompt = self.tokenizer.render_chat(messages, tools, kwargs)
            reply = self._reply(body, messages, max_tokens, prompt, tools, kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from None
        session = req.headers.get("x-session-id") or body.get("user")
        session = session if isinstance(session, str) else None
        key = self.held.key_of(body)
        if self.advisor is not None:
            self.advisor.describe(
                self._typed(messages, tools, kwargs, prompt),
                request_features(body, messages, max_tokens),
            )
        cached, total, _, decoder = self._prefill(prompt, salt, session, reply, key, model)
        await self._model_latency(total - cached)
        answer = reply.answer
        calls = reply.tool_calls
        finish = "tool_calls" if calls else ("length" if answer.truncated else "stop")
        completion = reply.completion_tokens
        usage = {
            "prompt_tokens": total,
            "completion_tokens": completion,
            "total_tokens": total + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        rid = self._next_id("chatcmpl-")
        created = int(time.time())
        headers = self._sim_headers(cached, total)
        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            delay, abort_after = self._stream_knobs(req)
            gen = self._chat_stream(
                rid,
                created,
                model,
                answer,
                finish,
                usage,
                include_usage,
                delay,
                abort_after,
                decoder,
                calls,
            )
            return StreamResponse(gen, headers=headers)
        await decoder.run()
        return json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": reply.message,
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
            },
            headers=headers,
        )

    async def _chat_stream(
        self,
        rid: str,
        created: int,
        model: str,
        answer: _Answer,
        finish: str,
        usage: dict[str, Any],
        include_usage: bool,
        delay: float,
        abort_after: int | None,
        decoder: _Decoder | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> AsyncIterator[bytes]:
        self.in_flight += 1
        try:

            def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
                obj: dict[str, Any] = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": finish_reason,
                        }
                    ],
                }
                if include_usage:
                    obj["usage"] = None  # OpenAI: present and null on all but the last chunk
                return b"data: " + dumps(obj) + b"\n\n"

            yield chunk({"role": "assistant", "content": ""})
            deltas: list[dict[str, Any]]
            if tool_calls:
                deltas = [{"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}]
            else:
                deltas = [{"content": piece} for piece in answer.pieces()]
            for i, delta in enumerate(deltas):
                if abort_after is not None and i >= abort_after:
                    raise _SimulatedAbort(f"aborted after {i} content chunks")
                if delay:
                    await asyncio.sleep(delay)
                if decoder is not None:
                    await decoder.share(i, len(deltas))
                yield chunk(delta)
            if decoder is not None:
                await decoder.run()
            yield chunk({}, finish)
            if include_usage:
                tail = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield b"data: " + dumps(tail) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def _trivial_chat(self, req: Request, body: dict[str, Any]) -> Response | StreamResponse:
        model = body.get("model")
        payload = self._trivial_bodies.get(model) if isinstance(model, str) else None
        if payload is None:
            model = self.config.models[0]
            payload = self._trivial_bodies[model]
        headers = self._sim_headers(0, 1)
        if not body.get("stream"):
            return Response(payload, 200, headers)
        answer = _Answer(["ok"], False)
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        delay, abort_after = self._stream_knobs(req)
        gen = self._chat_stream(
            "chatcmpl-trivial",
            self.started,
            str(model),
            answer,
            "stop",
            usage,
            include_usage,
            delay,
            abort_after,
        )
        return StreamResponse(gen, headers=headers)

    # -- Anthropic messages -----------------------------------------------------------------

    async def _messages(self, req: Request) -> Response | StreamResponse:
        body = self._json_body(req)
        model = self._model(body, required=True)
        max_tokens = self._max_tokens(body, "max_tokens", required=True)
        messages = _checked_messages(body.get("messages"))
        salt = _cache_salt(body)
        system, tools = body.get("system"), body.get("tools")
        try:
            prompt = self.tokenizer.render_anthropic(system, messages, tools)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from None
        answer = self._answer(_last_user_text(messages), max_tokens)
        reply = _Reply(answer, {"role": "assistant", "content": answer.text})
        if self.cache_output:
            chat, chat_tools = anthropic_to_openai(system, messages, tools)
            reply.token_ids = self.tokenizer.reply_tokens(prompt, chat, chat_tools, reply.message)
        key = self.held.key_of(body)
        cached, total, stored, decoder = self._prefill(prompt, salt, None, reply, key, model)
        await self._model_latency(total - cached)
        # Anthropic only writes cache where the request asks for it (cache_control); the
        # three input counters partition the prompt.
        creation = stored if _has_cache_control(body) else 0
        usage = {
            "input_tokens": total - cached - creation,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": cached,
            "output_tokens": 0,
        }
        usage["output_tokens"] = len(answer.words)
        stop_reason = "max_tokens" if answer.truncated else "end_turn"
        mid = self._next_id("msg_")
        headers = self._sim_headers(cached, total)
        if body.get("stream"):
            delay, abort_after = self._stream_knobs(req)
            gen = self._messages_stream(
                mid, model, answer, stop_reason, usage, delay, abort_after, decoder
            )
            return StreamResponse(gen, headers=headers)
        await decoder.run()
        return json_response(
            {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": answer.text}],
                "stop_reason": stop_reason,
                "stop_sequence": None,
                "usage": usage,
            },
            headers=headers,
        )

    async def _count_tokens(self, req: Request) -> Response:
        """Claude Code and the SDK's ``count_tokens`` call this before sending; no cache use."""
        body = self._json_body(req)
        self._model(body, required=True)
        messages = _checked_messages(body.get("messages"))
        system, tools = body.get("system"), body.get("tools")
        try:
            prompt = self.tokenizer.render_anthropic(system, messages, tools)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from None
        n = len(self.tokenizer.encode(prompt))
        return json_response({"input_tokens": n}, headers=self._headers)

    async def _messages_stream(
        self,
        mid: str,
        model: str,
        answer: _Answer,
        stop_reason: str,
        usage: dict[str, Any],
        delay: float,
        abort_after: int | None,
        decoder: _Decoder | None = None,
    ) -> AsyncIterator[bytes]:
        self.in_flight += 1
        try:

            def event(kind: str, data: dict[str, Any]) -> bytes:
                return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

            start_usage = dict(usage, output_tokens=1)
            yield event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": mid,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": start_usage,
                    },
                },
            )
            yield event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            yield event("ping", {"type": "ping"})
            pieces = answer.pieces()
            for i, piece in enumerate(pieces):
                if abort_after is not None and i >= abort_after:
                    raise _SimulatedAbort(f"aborted after {i} content chunks")
                if delay:
                    await asyncio.sleep(delay)
                if decoder is not None:
                    await decoder.share(i, len(pieces))
                yield event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": piece},
                    },
                )
            if decoder is not None:
                await decoder.run()
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": usage,
                },
            )
            yield event("message_stop", {"type": "message_stop"})
        finally:
            self.in_flight -= 1

    # -- OpenAI text completions and Responses (formats: .completions, .responses) --------

    async def _completions(self, req: Request) -> Response | StreamResponse:
        body = self._json_body(req)
        model = self._model(body)
        try:
            prompts = text_api.prompts_of(body.get("prompt"))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        max_tokens = self._max_tokens(body, "max_tokens") or text_api.DEFAULT_MAX_TOKENS
        salt = _cache_salt(body)
        choices: list[text_api.Choice] = []
        decoders: list[_Decoder] = []
        cached = total = completion = 0
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else ""
            answer = self._answer(text, max_tokens)
            reply = _Reply(answer, {"role": "assistant", "content": answer.text})
            if self.cache_output:
                reply.token_ids = self.tokenizer.encode(answer.text)
            n = self.held.max_prefix_length
            key = bytes(compute_prefix_key(model, "P", text, n)) if text else None
            ids = None if isinstance(prompt, str) else prompt
            c, t, _, decoder = self._prefill(text, salt, None, reply, key, model, ids)
            cached, total, completion = cached + c, total + t, completion + len(answer.words)
            choices.append(
                text_api.Choice(answer.pieces(), "length" if answer.truncated else "stop")
            )
            decoders.append(decoder)
        await self._model_latency(total - cached)
        usage = {
            "prompt_tokens": total,
            "total_tokens": total + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        rid, created = self._next_id("cmpl-"), int(time.time())
        headers = self._sim_headers(cached, total)
        if body.get("stream"):
            opts = body.get("stream_options")
            include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            delay, abort_after = self._stream_knobs(req)

            async def pace(i: int, j: int, n: int) -> None:
                if abort_after is not None and j >= abort_after:
                    raise _SimulatedAbort(f"aborted after {j} content chunks")
                if delay:
                    await asyncio.sleep(delay)
                await decoders[i].share(j, n)

            gen = text_api.completion_stream(
                rid, created, model, choices, usage if include_usage else None, pace
            )
            return StreamResponse(self._streaming(gen, decoders), headers=headers)
        for decoder in decoders:
            await decoder.run()
        return json_response(
            text_api.completion(rid, created, model, choices, usage), headers=headers
        )

    async def _responses(self, req: Request) -> Response | StreamResponse:
        body = self._json_body(req)
        model = self._model(body)
        try:
            chat, tools, choice = responses_api.conversation(body, self.stored_responses)
        except responses_api.UnknownResponse as e:
            raise ApiError(404, str(e)) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        max_tokens = self._max_tokens(body, "max_output_tokens")
        salt = _cache_salt(body)
        try:
            prompt = self.tokenizer.render_chat(chat, tools)
            reply = self._reply({"tool_choice": choice}, chat, max_tokens, prompt, tools)
        except ChatTemplateError as e:
            raise ApiError(400, str(e)) from None
        key = self.held.key_of({"model": model, "messages": chat})
        cached, total, _, decoder = self._prefill(prompt, salt, None, reply, key, model)
        await self._model_latency(total - cached)
        out = reply.completion_tokens
        usage = {
            "input_tokens": total,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total + out,
        }
        rid = self._next_id("resp_")
        output = responses_api.output_items(reply.message, self._next_id("msg_"))
        status = "incomplete" if reply.answer.truncated else "completed"
        done = responses_api.response_object(
            rid, int(time.time()), model, body, output, usage, status
        )
        if body.get("store", True):
            self.stored_responses[rid] = [*chat, reply.message]
            while len(self.stored_responses) > 1024:
                self.stored_responses.popitem(last=False)
        headers = self._sim_headers(cached, total)
        if body.get("stream"):
            delay, abort_after = self._stream_knobs(req)

            async def pace(j: int, n: int) -> None:
                if abort_after is not None and j >= abort_after:
                    raise _SimulatedAbort(f"aborted after {j} content chunks")
                if delay:
                    await asyncio.sleep(delay)
                await decoder.share(j, n)

            gen = responses_api.response_stream(done, reply.answer.pieces(), pace)
            return StreamResponse(self._streaming(gen, [decoder]), headers=headers)
        await decoder.run()
        return json_response(done, headers=headers)

    async def _streaming(
        self, gen: AsyncIterator[bytes], decoders: list[_Decoder]
    ) -> AsyncIterator[bytes]:
        """``gen`` counted in flight; every decoder finishes before the last record."""
        self.in_flight += 1
        try:
            pending: bytes | None = None
            async for chunk in gen:
                if pending is not None:
                    yield pending
                pending = chunk
            for decoder in decoders:
                await decoder.run()
            if pending is not None:
                yield pending
        finally:
            self.in_flight -= 1

    # -- embeddings, models, health ---------------------------------------------------------

    async def _embeddings(self, req: Request) -> Response:
        body = self._json_body(req)
        model = self._model(body)
        raw = body.get("input")
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
            items = [raw]  # one input given as token ids
        elif isinstance(raw, list) and raw and all(isinstance(x, str | list) for x in raw):
            items = raw
        else:
            raise ApiError(400, "'input' must be a string, an array of strings or token arrays")
        dims = body.get("dimensions") or 8
        if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= _MAX_EMBED_DIMS:
            raise ApiError(400, f"'dimensions' must be an integer in 1..{_MAX_EMBED_DIMS}")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be 'float' or 'base64'")
        data: list[dict[str, Any]] = []
        prompt_tokens = 0
        for i, item in enumerate(items):
            if isinstance(item, str):
                text = item
                prompt_tokens += len(self.tokenizer.encode(item))
            else:
                text = " ".join(str(t) for t in item)
                prompt_tokens += len(item)
            vec = embed(text, dims)
            emb: list[float] | str
            if fmt == "base64":
                emb = base64.b64encode(array("f", vec).tobytes()).decode()
            else:
                emb = vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            },
            headers=self._headers,
        )

    async def _models(self, req: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": self.started, "owned_by": "continuum-sim"}
            for m in self.config.models
        ]
        return json_response({"object": "list", "data": data}, headers=self._headers)

    async def _health(self, req: Request) -> Response:
        if self.config.unhealthy:
            return json_response({"status": "unhealthy"}, 503, self._headers)
        return json_response({"status": "ok"}, headers=self._headers)

    async def _metrics(self, req: Request) -> Response:
        """A few vLLM-named gauges/counters, for routers that balance on scraped load."""
        st = self.cache.stats
        lines: list[str] = []
        for model in self.config.models:
            lbl = f'{{model_name="{model}",engine="{self.config.name}"}}'
            lines += [
                f"vllm:num_requests_running{lbl} {self.in_flight}",
                f"vllm:num_requests_waiting{lbl} 0",
                f"vllm:kv_cache_usage_perc{lbl} {len(self.cache) / self.cache.capacity_blocks}",
                f"vllm:prefix_cache_queries_total{lbl} {st.prompt_tokens}",
                f"vllm:prefix_cache_hits_total{lbl} {st.cached_tokens}",
                f"vllm:request_success_total{lbl} {self.requests - self.errors}",
            ]
        return Response("\n".join(lines) + "\n", 200, self._headers, "text/plain; version=0.0.4")

    # -- /sim control plane -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        st = self.cache.stats
        return {
            "name": self.config.name,
            "models": list(self.config.models),
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": st.prompt_tokens,
            "cached_tokens": st.cached_tokens,
            "hit_rate": st.hit_rate,
            "prefill_seconds_modelled": st.prefill_seconds_modelled,
            "in_flight": self.in_flight,
            "cache_blocks": len(self.cache),
            "capacity_blocks": self.cache.capacity_blocks,
            "block_size": self.cache.block_size,
            "tokenizer": self.tokenizer.name,
            **({"kv_events": self.kv.stats()} if self.kv is not None else {}),
        }

    async def _stats(self, req: Request) -> Response:
        return json_response(self.stats(), headers=self._headers)

    async def _held_prefixes(self, req: Request) -> Response:
        """The prefix keys this engine truly holds (:mod:`harness.sim.held`): what a fault
        test compares the router's index with, never the listener's view of it."""
        return json_response(
            dict(self.held.report(), backend=self.config.name), headers=self._headers
        )

    async def _held_conversation(self, req: Request) -> Response:
        """The conversation keys this engine truly holds (:mod:`harness.sim.held`)."""
        return json_response(
            dict(self.held_conversation.report(), backend=self.config.name),
            headers=self._headers,
        )

    async def _reset(self, req: Request) -> Response:
        self._clear_cache()
        self.cache.reset_stats()
        self.requests = 0
        self.errors = 0
        self._last = None
        return json_response({"status": "reset"}, headers=self._headers)

    async def _last_request(self, req: Request) -> Response:
        last = self._last
        if last is None:
            return self._error(404, "no request recorded yet", False)
        headers = dict(self._headers, **{"x-sim-last-path": last.path})
        try:
            loads(last.body)
        except JSONDecodeError:
            return Response(last.body, 200, headers, "application/octet-stream")
        return Response(last.body, 200, headers)

    async def _last_headers(self, req: Request) -> Response:
        last = self._last
        if last is None:
            return self._error(404, "no request recorded yet", False)
        return json_response(last.headers, headers=self._headers)

    # -- engine utility endpoints -----------------------------------------------------------

    def _engine_error(self, status: int, message: str) -> Response:
        """vLLM's ErrorResponse: OpenAI shape with ``code`` = the HTTP status."""
        try:
            kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:
            kind = "BadRequestError"
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return json_response(body, status, self._headers)

    async def _detokenize(self, req: Request) -> Response:
        """vLLM ``{"model"?, "tokens": [...]}`` -> ``{"prompt": text}``; SGLang flavour also
        takes ``[[...], ...]`` (answering a list) and ``skip_special_tokens`` (default true)."""
        sglang = self.config.detokenize_format == "sglang"
        try:
            body = self._json_body(req)
            if "model" in body and body["model"] is not None:
                self._model(body, required=True)
            raw = body.get("tokens")
            if raw is None:
                raise ApiError(400, "tokens: Field required")
            skip = body.get("skip_special_tokens", True) if sglang else False
            if not isinstance(skip, bool):
                raise ApiError(400, "'skip_special_tokens' must be a boolean")
            batched = sglang and isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
            seqs = [_token_list(s) for s in raw] if batched else [_token_list(raw)]
            if any(s is None for s in seqs):
                shape = "integers >= 0 (or arrays of them)" if sglang else "integers >= 0"
                raise ApiError(400, f"'tokens' must be an array of {shape}")
            try:
                texts = [self.tokenizer.decode(s, skip) for s in seqs if s is not None]
            except DecodeError as e:
                raise ApiError(400, str(e)) from None
        except ApiError as e:
            self.errors += 1
            return self._engine_error(e.status, e.message)
        if sglang:
            return json_response({"text": texts if batched else texts[0]}, headers=self._headers)
        return json_response({"prompt": texts[0]}, headers=self._headers)

    async def _reset_prefix_cache(self, req: Request) -> Response:
        """vLLM's ``POST /reset_prefix_cache``: 200 with an empty body."""
        self._clear_cache()
        return Response(b"", 200, self._headers, "text/plain")

    async def _flush_cache(self, req: Request) -> Response:
        """SGLang's ``/flush_cache``."""
        self._clear_cache()
        return Response(b"Cache flushed.\n", 200, self._headers, "text/plain")

    async def _kv_cache_events(self, req: Request) -> Response:
        """trtllm-serve's destructive drain of queued KV events (a JSON array)."""
        assert self.kv is not None and self.kv.trtllm is not None
        return Response(await self.kv.trtllm.drain(), 200, self._headers)

    async def _burst(self, req: Request) -> Response:
        """``POST /sim/burst {"batches": N, "events_per_batch": 8, "blocks_per_event": 1,
        "chain_blocks": 64}``: publish synthetic BlockStored batches; answers the rate."""
        if self.kv is None:
            return self._error(
                409, "KV events are not enabled (--kv-events/--kv-events-trtllm)", False
            )
        try:
            body = self._json_body(req) if req.body.strip() else {}
        except ApiError as e:
            return self._error(e.status, e.message, False)
        args: dict[str, int] = {}
        limits = {
            "batches": (1, _MAX_BURST_BATCHES, 1000),
            "events_per_batch": (1, 65_536, 8),
            "blocks_per_event": (1, 4096, 1),
            "chain_blocks": (1, 1 << 20, 64),
        }
        for key, (lo, hi, default) in limits.items():
            v = body.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                return self._error(400, f"'{key}' must be an integer in {lo}..{hi}", False)
            args[key] = v
        result = await self.kv.burst(**args)
        return json_response(result, headers=self._headers)
