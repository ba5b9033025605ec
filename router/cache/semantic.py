"""Tier 2's semantic path: a paraphrase of an earlier question answered from the cache.

When the exact lookup misses, a deterministic chat completion whose last message is a
user turn is embedded (one ``POST /v1/embeddings`` to ``response_cache.semantic.backend``
under ``embedding_timeout_ms``; any failure is a plain miss) and compared by cosine
similarity with the stored questions of its *partition*. At or above the threshold the
stored answer is served (``X-Cache: HIT``, ``X-Cache-Mode: semantic``); otherwise the
vector is kept and the backend's answer is indexed under it once it arrives.

Isolation is the partition digest, SHA-256 over (each part length-prefixed)::

    version ‖ caller identity ‖ model ‖ embedding model
            ‖ every other request field but the excluded ones (canonical JSON)
            ‖ the whole history before the last user turn (canonical JSON)

so entries never cross API keys, system prompts, tools, response formats, sampling
parameters or seeds: a field the router does not know is output-shaping is in the digest
too. Only the last user turn is compared by meaning.

Storage: the answer bytes go to the response cache store under ``sem:<sha256 hex>`` (so
memory or Redis, sharing ``response_cache.capacity``), TTL from the policy's
``cache_ttl_secs``, else ``semantic.ttl``, else ``response_cache.ttl``. The vectors live
in this router's memory only (:class:`VectorIndex`): a vector whose body is gone from the
store is dropped when a lookup meets it.

numpy is imported where vectors are first handled, not with the module: a router without
the semantic cache does not pay its import time at every start.

Size: the partition digest, the vector index and the lookup stay together (about 500
lines): the digest decides which vectors a lookup may ever compare.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import orjson

from ..config.models import (
    OptimizationPolicyConfig,
    ResponseCacheConfig,
    SemanticCacheConfig,
    parse_duration,
)
from ..openai_api import bearer_headers, embeddings_path
from ..pool import BackendPool
from ..upstream import UpstreamClient, UpstreamError

if TYPE_CHECKING:
    import numpy as np  # imported when the first vector is made: numpy costs at start-up

__all__ = [
    "KEY_PREFIX",
    "PARTITION_EXCLUDED_FIELDS",
    "SemanticCache",
    "SemanticLookup",
    "VectorIndex",
    "entry_key",
    "last_user_text",
    "partition_digest",
    "semantic_active",
    "semantic_ineligible_reason",
    "semantic_threshold",
    "semantic_ttl",
]

log = logging.getLogger("continuum.cache.semantic")

KEY_PREFIX = "sem:"
"""Namespace of semantic bodies in the response cache store."""

PARTITION_EXCLUDED_FIELDS = frozenset(
    ("messages", "stream", "stream_options", "user", "metadata", "store")
)
"""Request fields left out of the partition digest: the messages (hashed apart), and
fields that never shape the answer. Everything else partitions."""

_DIGEST_VERSION = b"continuum-semantic-v1"
_MAX_CANDIDATES = 3
"""Candidates above the threshold tried in turn when the best one's body is gone."""
_SCORE_SLACK = 1e-6
"""float32 cosine of a vector with itself can fall just below 1.0."""
_EMBEDDING_TYPES = frozenset(("openai", "vllm", "sglang", "gemini"))
_MIN_ROWS = 8


# -- eligibility, partition, keys ------------------------------------------------------


def last_user_text(body: Mapping[str, Any]) -> str | None:
    """The text of the last message when it is a user turn of text only, else None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content or None
    if not isinstance(content, list) or not content:
        return None
    parts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            return None  # images, audio, files: not compared by text meaning
        text = part.get("text")
        if not isinstance(text, str):
            return None
        parts.append(text)
    joined = "\n".join(parts)
    return joined or None


def semantic_ineligible_reason(
    body: Mapping[str, Any], stream: bool, max_input_bytes: int
) -> str | None:
    """Why a request cannot take the semantic path, or None (it can)."""
    if stream:
        return "stream"
    t = body.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0:
        return "temperature"  # explicitly 0: an absent temperature samples on most APIs
    n = body.get("n")
    if n is not None and n != 1:
        return "n"
    text = last_user_text(body)
    if text is None:
        return "last_message"
    if len(text.encode("utf-8", "surrogatepass")) > max_input_bytes:
        return "max_input_bytes"
    return None


def _part(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def partition_digest(body: Mapping[str, Any], tenant: str | None, embedding_model: str) -> bytes:
    """The 32-byte partition of a request (see the module docstring)."""
    h = hashlib.sha256(_DIGEST_VERSION)
    _part(h, b"\x00" if tenant is None else b"\x01" + tenant.encode())
    _part(h, str(body.get("model")).encode("utf-8", "surrogatepass"))
    _part(h, embedding_model.encode("utf-8", "surrogatepass"))
    shaping = {k: v for k, v in body.items() if k not in PARTITION_EXCLUDED_FIELDS}
    _part(h, orjson.dumps(shaping, option=orjson.OPT_SORT_KEYS))
    messages = body.get("messages")
    history = messages[:-1] if isinstance(messages, list) else []
    _part(h, orjson.dumps(history, option=orjson.OPT_SORT_KEYS))
    return h.digest()


def entry_key(partition: bytes, text: str) -> str:
    """The store key of one (partition, question): ``sem:<sha256 hex>``."""
    h = hashlib.sha256(partition)
    h.update(b"\x00")
    h.update(text.encode("utf-8", "surrogatepass"))
    return KEY_PREFIX + h.hexdigest()


# -- policy ----------------------------------------------------------------------------


def semantic_active(rc: ResponseCacheConfig, policy: OptimizationPolicyConfig) -> bool:
    """Every switch the semantic path needs: config, router flag, and the policy's."""
    sem = rc.semantic
    return bool(
        rc.enabled
        and sem.enabled
        and sem.backend
        and sem.embedding_model
        and policy.semantic_cache_enabled
        and policy.cache_enabled
        and policy.exact_cache
        and policy.semantic_cache
    )


def semantic_threshold(sem: SemanticCacheConfig, policy: OptimizationPolicyConfig) -> float:
    """``semantic.threshold``, else the policy's ``semantic_similarity_bps`` / 10000."""
    if sem.threshold is not None:
        return sem.threshold
    return policy.semantic_similarity_bps / 10_000


def semantic_ttl(rc: ResponseCacheConfig, policy: OptimizationPolicyConfig) -> int:
    """Entry TTL in seconds: policy ``cache_ttl_secs`` → ``semantic.ttl`` → ``ttl``."""
    if policy.cache_ttl_secs is not None:
        return policy.cache_ttl_secs
    if rc.semantic.ttl is not None:
        return int(parse_duration(rc.semantic.ttl))
    return rc.ttl_seconds


# -- the vector index ------------------------------------------------------------------


class _Entry:
    __slots__ = ("expires", "key", "partition", "row")

    def __init__(self, key: str, partition: bytes, row: int, expires: float) -> None:
        self.key = key
        self.partition = partition
        self.row = row
        self.expires = expires


class _Partition:
    """Unit vectors of one partition as rows of one matrix: a search is one mat-vec."""

    __slots__ = ("entries", "matrix", "size")

    def __init__(self, dim: int) -> None:
        import numpy as np

        self.matrix = np.empty((_MIN_ROWS, dim), dtype=np.float32)
        self.entries: list[_Entry] = []
        self.size = 0


class VectorIndex:
    """Normalised vectors by partition, at most ``max_entries`` in all, oldest out first.

    Insertion order is one ``OrderedDict`` over every entry, so evicting the oldest is
    O(1); a partition drops a row by moving its last row into the hole (O(dim)). Not
    thread-safe; the router uses it from its event loop only.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._partitions: dict[bytes, _Partition] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def partitions(self) -> int:
        return len(self._partitions)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def resize(self, max_entries: int) -> None:
        self.max_entries = max_entries
        while len(self._entries) > max_entries:
            self._evict_oldest()

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self._partitions.clear()
        return n

    def add(self, partition: bytes, key: str, vector: np.ndarray, expires: float) -> None:
        """Index ``vector`` (unit length, float32) for ``key``; a re-add refreshes it."""
        if key in self._entries:
            self.remove(key)
        part = self._partitions.get(partition)
        if part is not None and part.matrix.shape[1] != vector.shape[0]:
            # The embedding model behind the name changed dimension: old vectors are void.
            for e in list(part.entries):
                self.remove(e.key)
        while len(self._entries) >= self.max_entries:
            self._evict_oldest()  # may empty (and drop) this very partition
        part = self._partitions.get(partition)
        if part is None:
            part = self._partitions[partition] = _Partition(vector.shape[0])
        if part.size == part.matrix.shape[0]:
            import numpy as np

            grown = np.empty((part.size * 2, part.matrix.shape[1]), dtype=np.float32)
            grown[: part.size] = part.matrix
            part.matrix = grown
        row = part.size
        part.matrix[row] = vector
        entry = _Entry(key, partition, row, expires)
        part.entries.append(entry)
        part.size += 1
        self._entries[key] = entry

    def remove(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        part = self._partitions[entry.partition]
        last = part.size - 1
        if entry.row != last:
            moved = part.entries[last]
            part.matrix[entry.row] = part.matrix[last]
            part.entries[entry.row] = moved
            moved.row = entry.row
        part.entries.pop()
        part.size = last
        if last == 0:
            del self._partitions[entry.partition]
        elif part.matrix.shape[0] > _MIN_ROWS and last <= part.matrix.shape[0] // 4:
            part.matrix = part.matrix[: part.matrix.shape[0] // 2].copy()
        return True

    def _evict_oldest(self) -> None:
        key = next(iter(self._entries))
        self.remove(key)
        self.evictions += 1

    def search(
        self,
        partition: bytes,
        vector: np.ndarray,
        threshold: float,
        now: float | None = None,
        limit: int = _MAX_CANDIDATES,
    ) -> list[tuple[float, str]]:
        """Live entries of ``partition`` with cosine >= ``threshold``, best first.

        Expired entries met on the way are removed.
        """
        import numpy as np

        part = self._partitions.get(partition)
        if part is None or part.matrix.shape[1] != vector.shape[0]:
            return []
        scores = part.matrix[: part.size] @ vector
        rows = np.flatnonzero(scores >= threshold - _SCORE_SLACK)
        if rows.size == 0:
            return []
        rows = rows[np.argsort(-scores[rows], kind="stable")]
        now = time.monotonic() if now is None else now
        found: list[tuple[float, str]] = []
        expired: list[str] = []
        for r in rows:
            entry = part.entries[int(r)]
            if entry.expires <= now:
                expired.append(entry.key)
                continue
            found.append((float(scores[r]), entry.key))
            if len(found) >= limit:
                break
        for key in expired:
            self.remove(key)
        return found


# -- the serving path ------------------------------------------------------------------


class SemanticLookup:
    """The outcome of one semantic lookup; on a miss, what to index the answer under."""

    __slots__ = ("body", "key", "partition", "result", "score", "vector")

    def __init__(
        self,
        result: Literal["hit", "miss"],
        *,
        body: bytes | None = None,
        score: float | None = None,
        partition: bytes | None = None,
        key: str | None = None,
        vector: np.ndarray | None = None,
    ) -> None:
        self.result = result
        self.body = body
        self.score = score
        self.partition = partition
        self.key = key
        self.vector = vector

    @property
    def storable(self) -> bool:
        return self.result == "miss" and self.vector is not None and self.key is not None


def _unit_vector(payload: bytes) -> np.ndarray | None:
    """``data[0].embedding`` of an OpenAI embeddings response, normalised; None if bad."""
    import numpy as np

    try:
        data = orjson.loads(payload)
        emb = data["data"][0]["embedding"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(emb, list) or not emb or len(emb) > 65_536:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in emb):
        return None
    vec = np.asarray(emb, dtype=np.float64)
    norm = float(np.linalg.norm(vec))
    if not math.isfinite(norm) or norm == 0.0:
        return None
    return (vec / norm).astype(np.float32)


class SemanticCache:
    """Embedding, index and ``sem:`` bodies for the response cache service."""

    def __init__(
        self,
        store: Any,
        pool: BackendPool,
        client: UpstreamClient,
        max_entries: int,
    ) -> None:
        self.store = store
        self.pool = pool
        self.client = client
        self.index = VectorIndex(max_entries)
        self.hits = 0
        self.misses = 0
        self.embedding_errors = 0
        self._last_error_log = 0.0

    async def lookup(
        self,
        body: Mapping[str, Any],
        tenant: str | None,
        rc: ResponseCacheConfig,
        policy: OptimizationPolicyConfig,
    ) -> SemanticLookup:
        """Embed the last user turn and search its partition (eligibility checked first)."""
        sem = rc.semantic
        assert sem.embedding_model is not None
        if self.index.max_entries != sem.max_entries:
            self.index.resize(sem.max_entries)  # hot reload of max_entries
        text = last_user_text(body)
        assert text is not None
        partition = partition_digest(body, tenant, sem.embedding_model)
        key = entry_key(partition, text)
        vector = await self.embed(sem, text)
        if vector is None:
            self.misses += 1
            return SemanticLookup("miss")
        threshold = semantic_threshold(sem, policy)
        for score, found in self.index.search(partition, vector, threshold):
            try:
                blob = await self.store.get(found)
            except Exception:
                log.warning("semantic cache read failed", exc_info=True)
                break
            if blob is not None and blob[:1] == b"J":
                self.hits += 1
                return SemanticLookup("hit", body=blob[1:], score=score)
            self.index.remove(found)  # its body expired or was evicted from the store
        self.misses += 1
        return SemanticLookup("miss", partition=partition, key=key, vector=vector)

    async def embed(self, sem: SemanticCacheConfig, text: str) -> np.ndarray | None:
        """One embeddings call to the configured backend; None on any failure."""
        b = self.pool.get(sem.backend or "")
        if b is None or not b.config.enabled or not b.healthy or b.type not in _EMBEDDING_TYPES:
            self._failed(f"backend {sem.backend!r} is not available for embeddings")
            return None
        path = embeddings_path(b)
        headers = bearer_headers(b)
        payload = orjson.dumps({"model": sem.embedding_model, "input": text})
        timeout = sem.embedding_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout):
                resp = await self.client.request(
                    b.name, "POST", b.url + path, headers, payload, client_timeout=timeout
                )
                data = await resp.read()
        except UpstreamError as exc:
            self._failed(f"embeddings call to {b.name} failed: {exc.detail}")
            return None
        except TimeoutError:
            self._failed(f"embeddings call to {b.name} timed out ({sem.embedding_timeout_ms} ms)")
            return None
        if resp.status != 200:
            self._failed(f"embeddings call to {b.name} answered {resp.status}")
            return None
        vector = _unit_vector(data)
        if vector is None:
            self._failed(f"embeddings response of {b.name} has no usable vector")
            return None
        return vector

    def _failed(self, why: str) -> None:
        """Counts and (rate-limited) logs a failed embedding; the caller answers None."""
        self.embedding_errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 10.0:  # one line per 10 s, not one per request
            self._last_error_log = now
            log.warning("semantic cache: %s; treated as a miss", why)

    async def save(self, pending: SemanticLookup, data: bytes, ttl_seconds: int) -> None:
        """Store an answer under its ``sem:`` key, then index its vector."""
        assert pending.key is not None and pending.vector is not None
        assert pending.partition is not None
        try:
            await self.store.set(pending.key, b"J" + data, ttl_seconds)
        except Exception:
            log.warning("semantic cache write failed", exc_info=True)
            return
        self.index.add(
            pending.partition, pending.key, pending.vector, time.monotonic() + ttl_seconds
        )

    def clear(self) -> int:
        return self.index.clear()
