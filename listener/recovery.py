"""Prefix recovery: from a chain's token IDs (or its cache salt) to the router's prefix key.

Two ways to learn which prefix a block chain belongs to:

* **salt echo** (``Attributor.from_salt``): the router put ``bus.salt`` into the request's
  ``cache_salt``; the engine echoes it on the chain's first block, so the key is read
  and its MAC checked without any I/O. Required for TensorRT-LLM (no /detokenize).
* **detokenize** (``Attributor.from_tokens``): ask the engine's ``POST /detokenize`` for
  the text of the chain, undo the chat template (``listener.templates``) and hash the
  anchor with ``bus.prefix_key.compute_prefix_key`` — the same function the router uses.

``Detokenizer`` is the HTTP client. It never blocks ingestion: callers run it in
background tasks; it bounds concurrency with a semaphore, times out, caches recent
answers in a small LRU keyed by a digest of the token sequence (sibling chains probe the
same prefixes), coalesces identical in-flight requests, and batches several sequences into
one request where the engine allows it (SGLang accepts ``tokens: [[...], ...]``; vLLM does
not, so its sequences go out as concurrent single requests). Failures raise
``DetokenizeError``; the caller leaves the chain unattributed and retries with backoff.

Privacy: salts, token IDs, detokenized text and response bodies are never logged, and
error messages carry only a status code or an exception class name.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from bus.prefix_key import DEFAULT_MAX_PREFIX_LENGTH, PrefixKey, compute_prefix_key
from bus.salt import verify_salt
from listener.templates import NO_ANCHOR, ChatTemplate, locate_anchor

_VERIFIED_SALTS = 4096
"""Verified salts remembered per source (about 200 B each)."""

__all__ = [
    "NEED_MORE",
    "Attributor",
    "DetokenizeError",
    "Detokenizer",
    "NeedMore",
    "Recovered",
    "RecoveryError",
]

log = logging.getLogger(__name__)


class NeedMore(enum.Enum):
    """The chain's text ends inside the anchor: wait for more blocks."""

    NEED_MORE = "need_more"


NEED_MORE = NeedMore.NEED_MORE


class RecoveryError(Exception):
    """Root of the errors this module raises."""


class DetokenizeError(RecoveryError):
    """The engine's /detokenize did not answer usefully.

    ``retryable`` is False for a 4xx other than 408/429 (the same tokens will fail again,
    e.g. an out-of-vocabulary ID): the caller should give the chain up instead.
    """

    def __init__(self, reason: str, *, status: int | None = None) -> None:
        super().__init__(reason if status is None else f"{reason} (HTTP {status})")
        self.status = status
        self.retryable = status is None or status >= 500 or status in (408, 429)


def _digest(tokens: array[int]) -> bytes:
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


def _as_array(tokens: Sequence[int]) -> array[int]:
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    try:
        return array("I", tokens)
    except (OverflowError, TypeError):
        raise DetokenizeError("token IDs must be integers in [0, 2**32)", status=400) from None


class Detokenizer:
    """Async client for an engine's ``POST /detokenize``.

    Args:
        url: the endpoint, e.g. ``http://vllm-1:8000/detokenize``.
        model: sent as ``model`` when set (must be a served model or LoRA name).
        flavor: ``vllm`` (answers ``{"prompt": ...}``) or ``sglang`` (``{"text": ...}``,
            batches, and needs ``skip_special_tokens: false`` to keep template markers).
        session: a shared ``aiohttp.ClientSession``; one is created (and closed by
            ``aclose``) otherwise.
        timeout: seconds per HTTP request.
        max_concurrency: requests in flight at once.
        cache_size: answers kept in the LRU; ``max_cache_chars`` bounds their total size.
        max_batch: sequences per batched request (SGLang).
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        flavor: Literal["vllm", "sglang"] = "vllm",
        session: aiohttp.ClientSession | None = None,
        timeout: float = 5.0,
        max_concurrency: int = 4,
        cache_size: int = 128,
        max_cache_chars: int = 4_000_000,
        max_batch: int = 16,
    ) -> None:
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"unknown detokenize flavor {flavor!r}")
        self.url, self.model, self.flavor = url, model, flavor
        self._session, self._own_session = session, session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._sem = asyncio.Semaphore(max_concurrency)
        self._cache: OrderedDict[bytes, str] = OrderedDict()
        self._cache_chars = 0
        self._cache_size, self._max_cache_chars = cache_size, max_cache_chars
        self._max_batch = max(1, max_batch)
        self._inflight: dict[bytes, asyncio.Future[str]] = {}
        self.requests = self.cache_hits = self.failures = 0

    async def __aenter__(self) -> Detokenizer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens kept). Raises ``DetokenizeError``."""
        return (await self.detokenize_many([tokens]))[0]

    async def detokenize_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """Texts of several sequences, in order; one failure fails the call."""
        arrays = [_as_array(s) for s in seqs]
        keys = [_digest(a) for a in arrays]
        out: dict[bytes, str] = {}
        waits: dict[bytes, asyncio.Future[str]] = {}
        todo: dict[bytes, array[int]] = {}
        for key, arr in zip(keys, arrays, strict=True):
            if key in out or key in waits or key in todo:
                continue
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                out[key] = hit
            elif key in self._inflight:
                waits[key] = self._inflight[key]
            else:
                todo[key] = arr
        if todo:
            loop = asyncio.get_running_loop()
            mine = {k: loop.create_future() for k in todo}
            for k, fut in mine.items():
                fut.add_done_callback(_consume)
                self._inflight[k] = fut
            try:
                items = list(todo.items())
                step = self._max_batch if self.flavor == "sglang" else 1
                chunks = [items[i : i + step] for i in range(0, len(items), step)]
                texts = await asyncio.gather(*(self._fetch(c) for c in chunks))
                for chunk, got in zip(chunks, texts, strict=True):
                    for (k, _), text in zip(chunk, got, strict=True):
                        out[k] = text
                        self._remember(k, text)
                        mine[k].set_result(text)
            except BaseException as exc:
                for fut in mine.values():
                    if not fut.done():
                        err = exc if isinstance(exc, Exception) else None
                        fut.set_exception(err or DetokenizeError("detokenize cancelled"))
                raise
            finally:
                for k in mine:
                    self._inflight.pop(k, None)
        for k, fut in waits.items():
            out[k] = await asyncio.shield(fut)
        return [out[k] for k in keys]

    def _remember(self, key: bytes, text: str) -> None:
        if len(text) > self._max_cache_chars:
            return
        self._cache[key] = text
        self._cache_chars += len(text)
        while self._cache and (
            len(self._cache) > self._cache_size or self._cache_chars > self._max_cache_chars
        ):
            _, old = self._cache.popitem(last=False)
            self._cache_chars -= len(old)

    async def _fetch(self, chunk: list[tuple[bytes, array[int]]]) -> list[str]:
        batched = len(chunk) > 1
        body: dict[str, Any] = {
            "tokens": [a.tolist() for _, a in chunk] if batched else chunk[0][1].tolist()
        }
        if self.model is not None:
            body["model"] = self.model
        if self.flavor == "sglang":
            body["skip_special_tokens"] = False
        async with self._sem:
            self.requests += 1
            try:
                obj = await self._post(orjson.dumps(body))
            except DetokenizeError:
                self.failures += 1
                raise
        value = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        if batched:
            if (
                isinstance(value, list)
                and len(value) == len(chunk)
                and all(isinstance(v, str) for v in value)
            ):
                return value
        elif isinstance(value, str):
            return [value]
        self.failures += 1
        raise DetokenizeError("detokenize answered without the expected text field")

    async def _post(self, payload: bytes) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(
                self.url,
                data=payload,
                headers={"Content-Type": "application/json"},
                timeout=self._timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise DetokenizeError("detokenize failed", status=resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DetokenizeError(f"detokenize unreachable: {type(exc).__name__}") from None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise DetokenizeError("detokenize answered with invalid JSON") from None


def _consume(fut: asyncio.Future[str]) -> None:
    """Mark a shared future's exception as retrieved: nobody may be waiting on it."""
    if not fut.cancelled():
        fut.exception()


@dataclass(frozen=True, slots=True)
class Recovered:
    """A recovered key, and where in the text (0..1] the anchor became decidable."""

    key: PrefixKey
    decided_at: float


class Attributor:
    """Everything one source needs to name a chain's prefix.

    Args:
        model: the model name the router hashes (the request's ``model``).
        template: the engine's chat template, or several to try in order (the first
            whose grammar matches the text decides; config's "unset" = CHATML, LLAMA3).
        backend: the source's backend name; salts are bound to it.
        detokenizer: None when the engine has no /detokenize (TensorRT-LLM): then only
            salted chains can be attributed.
        max_prefix_length: the router's ``prefix_routing.max_prefix_length``.
        salt_secret: the HMAC secret shared with the router; None disables salt echo.
    """

    def __init__(
        self,
        *,
        model: str,
        template: ChatTemplate | Sequence[ChatTemplate],
        backend: str,
        detokenizer: Detokenizer | None = None,
        max_prefix_length: int | None = DEFAULT_MAX_PREFIX_LENGTH,
        salt_secret: bytes | None = None,
    ) -> None:
        self.model, self.backend = model, backend
        self.templates = (template,) if isinstance(template, ChatTemplate) else tuple(template)
        if not self.templates:
            raise ValueError("at least one chat template is needed")
        self.detokenizer = detokenizer
        self.max_prefix_length = max_prefix_length
        self._secret = salt_secret
        self._verified: OrderedDict[str, PrefixKey | None] = OrderedDict()

    @property
    def can_detokenize(self) -> bool:
        return self.detokenizer is not None

    def from_salt(self, salt: str) -> PrefixKey | None:
        """The key a router-issued salt carries; None if not ours (or no secret).

        Raises ``bus.salt.SaltError`` when the salt is ours but its MAC does not verify.
        """
        if self._secret is None:
            return None
        # A salt is a deterministic function of (secret, backend, prefix, caller salt), and
        # every request under one system prompt sends the same one: remember the verified
        # ones (bounded, most recent kept) rather than computing an HMAC per chain. Salts
        # that fail are not remembered; each one is checked (and counted) again.
        verified = self._verified
        if salt in verified:
            verified.move_to_end(salt)
            return verified[salt]
        info = verify_salt(self._secret, self.backend, salt)
        key = None if info is None else PrefixKey(info.prefix_key)
        verified[salt] = key
        if len(verified) > _VERIFIED_SALTS:
            verified.popitem(last=False)
        return key

    def from_text(self, text: str, *, complete: bool = False) -> Recovered | NeedMore | None:
        """Key of a detokenized chain; NEED_MORE while the anchor is cut; None: no anchor."""
        loc = NO_ANCHOR
        for template in self.templates:
            loc = locate_anchor(
                text, template, complete=complete, max_prefix_length=self.max_prefix_length
            )
            if loc.kind != "no_anchor":
                break
        if loc.kind == "need_more":
            return NEED_MORE
        if loc.kind != "found" or loc.tag is None or loc.content is None:
            return None
        key = compute_prefix_key(self.model, loc.tag, loc.content, self.max_prefix_length)
        return Recovered(key, loc.end / max(len(text), 1))

    async def recover_many(
        self, seqs: Sequence[Sequence[int]], *, complete: bool = False
    ) -> list[Recovered | NeedMore | None]:
        """``from_text`` over the texts of several token sequences (one batched call)."""
        if self.detokenizer is None:
            return [None] * len(seqs)
        texts = await self.detokenizer.detokenize_many(seqs)
        return [self.from_text(t, complete=complete) for t in texts]

    async def from_tokens(
        self, tokens: Sequence[int], *, complete: bool = False
    ) -> PrefixKey | NeedMore | None:
        """Key of a chain given as token IDs from token 0. Raises ``DetokenizeError``."""
        (res,) = await self.recover_many([tokens], complete=complete)
        return res.key if isinstance(res, Recovered) else res
