"""Redis KV index: shared by every router instance, with an automatic in-memory fallback.

Layout, per prefix (``<kp>`` is the key prefix, ``cr:kvidx:`` by default)::

    <kp><prefix_hash>     sorted set   member = backend, score = token_count
    <kp><prefix_hash>:t   hash         field  = backend, value = <tier><expires_at_ms>

The sorted set is exactly the seed's layout (``ZADD cr:kvidx:<hash> <tokens> <backend>``),
so tools that read it keep working. The companion hash carries what a score cannot: the
tier (``g`` GpuHot, ``s`` StorageWarm) and the entry's own expiry in Unix milliseconds,
e.g. ``g1718000000000``. Per-entry expiry gives Redis the same TTL semantics as the memory
index: an entry expires ``ttl`` after *its* last event, even while other backends keep the
prefix alive. Both keys also carry ``PEXPIRE ttl`` (refreshed by every write, so a key lives
exactly as long as its newest entry), which reclaims whole prefixes without any sweep.
A member without a hash field (written by a foreign tool) is read as GpuHot whose expiry is
the key's upper bound, now + ttl (the key TTL, never longer, still bounds it).

Why a hash rather than the tier in the member (``backend|s``): the expiry needs a home
anyway, and the member stays the bare backend name the seed specifies.

Operations, one round trip each:

* query: ``ZREVRANGEBYSCORE key +inf -inf WITHSCORES`` and ``HGETALL key:t`` pipelined on
  one pooled connection (not redis-py's ``Pipeline`` object, whose bookkeeping costs more
  than the second command); expired entries are filtered client-side and never returned;
* upsert: ``MULTI ZADD HSET PEXPIRE PEXPIRE EXEC``; remove: ``MULTI HGET ZREM HDEL EXEC``;
* set_tier: a short script (change the tier only if the member exists and is live);
* remove_backend / clear / stats / cleanup_expired: ``SCAN`` over the key prefix with a
  TYPE filter, never ``KEYS``; these are rare (resync, admin, a periodic sweep).

Expired entries inside a live prefix are hidden on read and removed by ``cleanup_expired``,
which sweeps up to ``sweep_keys`` hashes per call, resuming its SCAN cursor next time, and
deletes a field only if it still holds the value it read (compare-and-delete script), so a
concurrent refresh by another instance is never lost.

Fallback: a connection error, timeout, read-only replica, OOM or loading Redis
(``UNAVAILABLE_ERRORS``) switches the index to ``fallback`` (an :class:`InMemoryKvIndex`):
queries and writes go to memory until Redis answers again. The switching itself
(``fallback_active``, one engage per outage, the monitor task that PINGs Redis every
``monitor_interval_s``, ``try_recover``) is the shared
:class:`~router.redis.FallbackSupervisor`, explained there. The index's own
replay, before switching back: what changed while Redis was away is written into it
(pending ``clear``, ``remove_backend``s, then the final state of every touched (prefix,
backend): written if live in memory, deleted if its last operation was a removal), in
rounds until nothing is left; then the fallback is emptied and Redis serves again, with no
await between the last replay round and the flag, so no write falls between the two
stores. More touched pairs than twice the fallback's ``max_entries`` replay the whole
fallback instead (removals not replayed are left to the TTL). Writes that arrive during
the outage for prefixes known only to Redis are not lost; reads of them miss until
recovery (the scorer then routes by prefix hash alone). A Redis that restarted empty is
refilled by what this instance saw during the outage and, afterwards, by new events.
Without a fallback, the same errors raise :class:`KvIndexUnavailable`.

Clocks: expiries are Unix time (``clock``, default ``time.time``), shared by every
instance; keep router clocks in sync (NTP). Redis Cluster is not supported (the two keys of a
prefix are not hash-tagged into one slot).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis

from router.redis import UNAVAILABLE_ERRORS, FallbackSupervisor, SupervisedStore, glob_escape

from .base import (
    EMPTY,
    Change,
    IndexEntry,
    IndexStats,
    KvIndex,
    KvIndexError,
    KvIndexUnavailable,
    Tier,
)
from .memory import InMemoryKvIndex

__all__ = ["DEFAULT_KEY_PREFIX", "RedisKvIndex"]

log = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "cr:kvidx:"


_TIER_CODE = {Tier.GPU_HOT: b"g", Tier.STORAGE_WARM: b"s"}
_CODE_TIER = {ord("g"): Tier.GPU_HOT, ord("s"): Tier.STORAGE_WARM}
_MAX_NAMES = 4096
_SCAN_COUNT = 500
_REPLAY_CHUNK = 128
_MAX_REPLAY_ROUNDS = 8

# KEYS: zset, hash. ARGV: backend, new hash value, ttl_ms, now_ms.
_SET_TIER_LUA = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local v = redis.call('HGET', KEYS[2], ARGV[1])
local e = v and tonumber(string.sub(v, 2))
if e and e <= tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: zset and hash of each change, in order. ARGV: ttl_ms, now_ms, then per change:
# op (u = upsert, r = remove), backend, token_count, hash value. The same commands as
# upsert's MULTI and remove's, in one script; returns how many removes found their entry
# already expired (remove()'s ``expired`` count).
_WRITE_MANY_LUA = """
local ttl, now, expired = ARGV[1], tonumber(ARGV[2]), 0
for i = 1, #KEYS / 2 do
  local key, tkey, a = KEYS[2 * i - 1], KEYS[2 * i], 4 * i - 1
  local backend = ARGV[a + 1]
  if ARGV[a] == 'u' then
    redis.call('ZADD', key, ARGV[a + 2], backend)
    redis.call('HSET', tkey, backend, ARGV[a + 3])
    redis.call('PEXPIRE', key, ttl)
    redis.call('PEXPIRE', tkey, ttl)
  else
    local v = redis.call('HGET', tkey, backend)
    if redis.call('ZREM', key, backend) == 1 and v and tonumber(string.sub(v, 2)) <= now then
      expired = expired + 1
    end
    redis.call('HDEL', tkey, backend)
  end
end
return expired
"""
_WRITE_BATCH = 256
"""Changes per ``write_many`` script call: one round trip, and Redis busy for well under
a millisecond per call (a script blocks every other client while it runs)."""

# KEYS: zset, hash. ARGV: backend1, value1, backend2, value2, ... (the values read).
_PRUNE_LUA = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[2], ARGV[i])
    n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return n
"""


def _expiry_ms(value: bytes) -> float:
    """Expiry of a hash value ``<tier><ms>``; ``inf`` for a value we did not write."""
    try:
        return int(value[1:])
    except ValueError:
        return math.inf


class RedisKvIndex(SupervisedStore, KvIndex):
    """KV index in Redis sorted sets, falling back to memory while Redis is unusable."""

    kind = "redis"

    def __init__(
        self,
        redis: Redis,
        ttl_seconds: float = 600.0,
        fallback: InMemoryKvIndex | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        monitor_interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        sweep_keys: int = 10_000,
        stats_cache_s: float = 10.0,
        owns_redis: bool = False,
    ) -> None:
        """
        Args:
            redis: a client whose pool may be shared (``RedisPools``); never closed here.
            ttl_seconds: an entry expires this long after its last event.
            fallback: serves while Redis is unusable; None makes errors raise instead.
            key_prefix: namespace of this index's keys; everything under it is ours.
            monitor_interval_s: PING period while the fallback is active.
            clock: Unix seconds; per-entry expiries are on this clock.
            sweep_keys: hashes examined per ``cleanup_expired`` call.
            stats_cache_s: how long ``stats()`` reuses its SCAN counts.
            owns_redis: ``close`` also closes ``redis`` (a client nobody else uses).
        """
        if not ttl_seconds > 0:
            raise ValueError("ttl_seconds must be positive")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        self._redis = redis
        self._owns_redis = owns_redis
        self._pool = redis.connection_pool
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        self._fallback = fallback
        self.key_prefix = key_prefix
        self._kp = key_prefix.encode()
        self._zset_match = glob_escape(self._kp) + b"*"
        self._hash_match = glob_escape(self._kp) + b"*:t"
        self.clock = clock
        self._sweep_keys = sweep_keys
        self._stats_cache_s = stats_cache_s
        self._set_tier_script = redis.register_script(_SET_TIER_LUA)
        self._prune_script = redis.register_script(_PRUNE_LUA)
        self._write_many_script = redis.register_script(_WRITE_MANY_LUA)
        self._names: dict[bytes, str] = {}
        self._hits = 0
        self._expired = 0
        self._stats_cache: tuple[float, int, int] | None = None
        self._sweep_cursor = 0
        # Fallback state.
        self._supervisor = FallbackSupervisor(
            "KV index",
            ping=redis.ping,
            replay=self._replay,
            switch_back=self._switch_back,
            unavailable=UNAVAILABLE_ERRORS,
            interval_s=monitor_interval_s,
            logger=log,
        )
        self._dirty: dict[tuple[str, str], bool] = {}  # (prefix, backend) -> last op was a put
        self._dirty_cap = 2 * fallback.max_entries if fallback is not None else 0
        self._dirty_overflow = False
        self._pending_backends: set[str] = set()
        self._pending_clear = False

    # ---- state -----------------------------------------------------------------------

    @property
    def redis(self) -> Redis:
        """The client this index uses (closed by ``close`` only if ``owns_redis``)."""
        return self._redis

    @property
    def fallback(self) -> InMemoryKvIndex | None:
        return self._fallback

    def _key(self, prefix_hash: str) -> bytes:
        return self._kp + prefix_hash.encode()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _name(self, member: bytes) -> str:
        name = self._names.get(member)
        if name is None:
            name = member.decode()
            if len(self._names) < _MAX_NAMES:
                self._names[member] = name
        return name

    # ---- wire ------------------------------------------------------------------------

    async def _roundtrip(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send ``commands`` pipelined on one pooled connection and read every reply.

        A connection error retries once on a fresh socket (every command we pipeline is
        idempotent); any other failure drops the connection, whose unread replies would
        otherwise poison the pool.
        """
        pool = self._pool
        conn = await pool.get_connection()
        try:
            packed = conn.pack_commands(commands)
            try:
                await conn.send_packed_command(packed)
                return [await conn.read_response() for _ in commands]
            except rx.ConnectionError:
                await conn.disconnect()
                await conn.send_packed_command(packed)
                return [await conn.read_response() for _ in commands]
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def _transaction(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``MULTI commands EXEC`` in one round trip; the EXEC reply list."""
        replies = await self._roundtrip([(b"MULTI",), *commands, (b"EXEC",)])
        result = replies[-1]
        if not isinstance(result, list):
            raise KvIndexError(f"unexpected EXEC reply {result!r}")
        for r in result:
            if isinstance(r, Exception):
                raise r
        return result

    def _put_cmds(
        self, key: bytes, backend: str, token_count: int, tier: Tier, expires_ms: int
    ) -> list[tuple[Any, ...]]:
        tkey = key + b":t"
        return [
            (b"ZADD", key, token_count, backend),
            (b"HSET", tkey, backend, _TIER_CODE[tier] + str(expires_ms).encode()),
            (b"PEXPIRE", key, self._ttl_ms),
            (b"PEXPIRE", tkey, self._ttl_ms),
        ]

    def _decode(self, zreply: Any, hreply: Any) -> Sequence[IndexEntry]:
        if not zreply:
            return EMPTY
        if isinstance(hreply, dict):  # RESP3 map
            meta = hreply
        else:  # RESP2 flat list
            meta = dict(zip(hreply[::2], hreply[1::2], strict=True))
        if isinstance(zreply[0], list):  # RESP3: [[member, score], ...]
            pairs: Any = zreply
        else:  # RESP2: [member, score, member, score, ...]
            pairs = zip(zreply[::2], zreply[1::2], strict=True)
        now_ms = self._now_ms()
        out: list[IndexEntry] = []
        for member, score in pairs:
            value = meta.get(member)
            if value is None:  # written by a foreign tool: GpuHot, the key TTL bounds it
                tier, exp = Tier.GPU_HOT, now_ms + self._ttl_ms
            else:
                exp = _expiry_ms(value)
                if exp <= now_ms:
                    continue
                if exp == math.inf:  # not our format: bounded by the key TTL
                    exp = now_ms + self._ttl_ms
                tier = _CODE_TIER.get(value[0], Tier.GPU_HOT) if value else Tier.GPU_HOT
            out.append(IndexEntry(self._name(member), int(float(score)), tier, exp / 1000.0))
        if not out:
            return EMPTY
        self._hits += 1
        return tuple(out)

    # ---- fallback --------------------------------------------------------------------

    def _fail(self, operation: str, exc: BaseException) -> InMemoryKvIndex:
        """Switch to the fallback (or raise without one); returns the fallback."""
        fb = self._fallback
        if fb is None:
            raise KvIndexUnavailable(self.kind, operation, exc) from exc
        self._supervisor.engage(operation, exc)
        return fb

    def _mark(self, prefix_hash: str, backend: str, put: bool) -> None:
        if self._dirty_overflow:
            return
        dirty = self._dirty
        dirty.pop((prefix_hash, backend), None)  # keep the dict ordered by last touch
        dirty[(prefix_hash, backend)] = put
        if len(dirty) > self._dirty_cap:
            # Too much to replay pair by pair: replay the whole fallback instead; removals
            # not replayed are left to the TTL.
            self._dirty = {}
            self._dirty_overflow = True

    def start_monitor(self, interval_s: float | None = None) -> None:
        """Start the task that PINGs Redis while the fallback is active and switches back
        when it answers (started by every outage anyway); ``interval_s`` replaces
        ``monitor_interval_s``. Needs a running loop."""
        self._supervisor.start_monitor(interval_s)

    async def _replay(self) -> bool:
        """Replay the outage's changes in rounds; False while writes keep arriving."""
        for _ in range(_MAX_REPLAY_ROUNDS):
            if not await self._replay_round():
                break
        return not (
            self._pending_clear or self._pending_backends or self._dirty or self._dirty_overflow
        )

    def _switch_back(self) -> str:
        fb = self._fallback
        if fb is not None:
            fb.drop_all()
        self._stats_cache = None
        return "outage changes replayed"

    async def _replay_round(self) -> bool:
        """Push one round of outage changes to Redis; False when there was nothing."""
        fb = self._fallback
        assert fb is not None
        did = False
        if self._pending_clear:
            self._pending_clear = False
            try:
                await self._redis_clear()
            except BaseException:
                self._pending_clear = True
                raise
            did = True
        while self._pending_backends:
            backend = next(iter(self._pending_backends))
            await self._redis_remove_backend(backend)
            self._pending_backends.discard(backend)
            did = True
        if self._dirty_overflow:
            self._dirty_overflow = False
            batch: dict[tuple[str, str], bool] = {(p, e.backend): True for p, e in fb.items()}
        else:
            batch, self._dirty = self._dirty, {}
        if batch:
            try:
                await self._replay_pairs(fb, batch)
            except BaseException:
                for pair, put in batch.items():
                    self._dirty.setdefault(pair, put)
                raise
            did = True
        return did

    async def _replay_pairs(self, fb: InMemoryKvIndex, batch: dict[tuple[str, str], bool]) -> None:
        cmds: list[tuple[Any, ...]] = []
        pairs = 0
        now_ms = self._now_ms()
        fb_now = fb.clock()
        for (prefix_hash, backend), put in batch.items():
            key = self._key(prefix_hash)
            e = fb.get(prefix_hash, backend)
            if e is not None:
                expires_ms = now_ms + int((e.expires_at - fb_now) * 1000)
                cmds += self._put_cmds(key, backend, e.token_count, e.tier, expires_ms)
            elif not put:
                cmds += [(b"ZREM", key, backend), (b"HDEL", key + b":t", backend)]
            else:
                continue  # written during the outage, since expired or evicted: nothing
            pairs += 1
            if pairs >= _REPLAY_CHUNK:
                await self._transaction(cmds)
                cmds, pairs = [], 0
        if cmds:
            await self._transaction(cmds)

    # ---- KvIndex ---------------------------------------------------------------------

    async def query_backends(self, prefix_hash: str) -> Sequence[IndexEntry]:
        if self._supervisor.active:
            return self._fallback.lookup(prefix_hash)  # type: ignore[union-attr]
        key = self._key(prefix_hash)
        try:
            zreply, hreply = await self._roundtrip(
                (
                    (b"ZREVRANGEBYSCORE", key, b"+inf", b"-inf", b"WITHSCORES"),
                    (b"HGETALL", key + b":t"),
                )
            )
        except UNAVAILABLE_ERRORS as exc:
            return self._fail("query", exc).lookup(prefix_hash)
        return self._decode(zreply, hreply)

    def _uncount_hit(self) -> None:
        if self._supervisor.active:
            self._fallback._uncount_hit()  # type: ignore[union-attr]
        else:
            self._hits -= 1

    async def backend_counts(self) -> dict[str, int]:
        if self._supervisor.active:
            return self._fallback.count_per_backend()  # type: ignore[union-attr]
        counts: dict[str, int] = {}
        cursor = 0
        try:
            while True:
                cursor, keys = await self._scan(self._zset_match, "zset", cursor)
                if keys:
                    replies = await self._roundtrip(tuple((b"ZRANGE", k, 0, -1) for k in keys))
                    for members in replies:
                        for m in members:
                            name = self._name(m)
                            counts[name] = counts.get(name, 0) + 1
                if cursor == 0:
                    break
        except UNAVAILABLE_ERRORS as exc:
            return self._fail("backend_counts", exc).count_per_backend()
        return counts

    async def upsert(self, prefix_hash: str, backend: str, token_count: int, tier: Tier) -> None:
        if token_count < 0:
            raise ValueError("token_count must be non-negative")
        if not self._supervisor.active:
            expires_ms = self._now_ms() + self._ttl_ms
            try:
                await self._transaction(
                    self._put_cmds(self._key(prefix_hash), backend, token_count, tier, expires_ms)
                )
                return
            except UNAVAILABLE_ERRORS as exc:
                self._fail("upsert", exc)
        self._fallback.put(prefix_hash, backend, token_count, tier)  # type: ignore[union-attr]
        self._mark(prefix_hash, backend, True)

    async def write_many(self, changes: Sequence[Change]) -> None:
        """One script call per ``_WRITE_BATCH`` changes instead of a MULTI/EXEC each: the
        consumer's cost per event in Redis mode was redis-py's per-command packing and
        reply reading (about 230 us of CPU per upsert), not Redis. Each call is atomic,
        like a single upsert or remove."""
        for _, _, token_count, tier in changes:
            if tier is not None and token_count < 0:
                raise ValueError("token_count must be non-negative")
        for start in range(0, len(changes), _WRITE_BATCH):
            part = changes[start : start + _WRITE_BATCH]
            if not self._supervisor.active:
                now_ms = self._now_ms()
                value_tail = str(now_ms + self._ttl_ms).encode()
                keys: list[bytes] = []
                args: list[Any] = [self._ttl_ms, now_ms]
                for prefix_hash, backend, token_count, tier in part:
                    key = self._key(prefix_hash)
                    keys += (key, key + b":t")
                    if tier is None:
                        args += (b"r", backend, 0, b"")
                    else:
                        args += (b"u", backend, token_count, _TIER_CODE[tier] + value_tail)
                try:
                    self._expired += int(await self._write_many_script(keys=keys, args=args))
                    continue
                except UNAVAILABLE_ERRORS as exc:
                    self._fail("write_many", exc)
            fb = self._fallback
            assert fb is not None  # _fail raised otherwise
            for prefix_hash, backend, token_count, tier in part:
                if tier is None:
                    fb.drop(prefix_hash, backend)
                else:
                    fb.put(prefix_hash, backend, token_count, tier)
                self._mark(prefix_hash, backend, tier is not None)

    async def set_tier(self, prefix_hash: str, backend: str, tier: Tier) -> bool:
        if not self._supervisor.active:
            key = self._key(prefix_hash)
            now_ms = self._now_ms()
            value = _TIER_CODE[tier] + str(now_ms + self._ttl_ms).encode()
            try:
                done = await self._set_tier_script(
                    keys=[key, key + b":t"], args=[backend, value, self._ttl_ms, now_ms]
                )
                return bool(done)
            except UNAVAILABLE_ERRORS as exc:
                self._fail("set_tier", exc)
        done = self._fallback.retier(prefix_hash, backend, tier)  # type: ignore[union-attr]
        if done:
            self._mark(prefix_hash, backend, True)
        return done

    async def remove(self, prefix_hash: str, backend: str) -> bool:
        if not self._supervisor.active:
            key = self._key(prefix_hash)
            tkey = key + b":t"
            try:
                value, removed, _ = await self._transaction(
                    [(b"HGET", tkey, backend), (b"ZREM", key, backend), (b"HDEL", tkey, backend)]
                )
            except UNAVAILABLE_ERRORS as exc:
                self._fail("remove", exc)
            else:
                if not removed:
                    return False
                if value is not None and _expiry_ms(value) <= self._now_ms():
                    self._expired += 1
                    return False
                return True
        done = self._fallback.drop(prefix_hash, backend)  # type: ignore[union-attr]
        self._mark(prefix_hash, backend, False)
        return done

    async def remove_backend(self, backend: str) -> int:
        if not self._supervisor.active:
            try:
                return await self._redis_remove_backend(backend)
            except UNAVAILABLE_ERRORS as exc:
                self._fail("remove_backend", exc)
        self._pending_backends.add(backend)
        return self._fallback.drop_backend(backend)  # type: ignore[union-attr]

    async def clear(self) -> int:
        if not self._supervisor.active:
            try:
                return await self._redis_clear()
            except UNAVAILABLE_ERRORS as exc:
                self._fail("clear", exc)
        self._pending_clear = True
        self._pending_backends.clear()
        self._dirty = {}
        self._dirty_overflow = False
        return self._fallback.drop_all()  # type: ignore[union-attr]

    async def cleanup_expired(self) -> int:
        if not self._supervisor.active:
            try:
                return await self._redis_sweep()
            except UNAVAILABLE_ERRORS as exc:
                self._fail("cleanup_expired", exc)
        return self._fallback.sweep()  # type: ignore[union-attr]

    async def stats(self) -> IndexStats:
        if not self._supervisor.active:
            try:
                prefixes, entries = await self._redis_counts()
            except UNAVAILABLE_ERRORS as exc:
                self._fail("stats", exc)
            else:
                return IndexStats(
                    kind=self.kind,
                    prefix_count=prefixes,
                    entry_count=entries,
                    total_hits=self._hits,
                    total_evictions=0,
                    total_expired=self._expired,
                )
        fb = self._fallback.snapshot_stats()  # type: ignore[union-attr]
        return IndexStats(
            kind=self.kind,
            prefix_count=fb.prefix_count,
            entry_count=fb.entry_count,
            total_hits=self._hits + fb.total_hits,
            total_evictions=fb.total_evictions,
            total_expired=self._expired + fb.total_expired,
            fallback_active=True,
        )

    async def close(self) -> None:
        """Stop the monitor; close the client only if ``owns_redis``. Idempotent."""
        await self._supervisor.close()
        if self._owns_redis:
            self._owns_redis = False
            await self._redis.aclose(close_connection_pool=True)

    # ---- scans (rare: resync, admin, sweep) -------------------------------------------

    async def _scan(self, match: bytes, type_: str | None, cursor: int = 0) -> tuple[int, list]:
        return await self._redis.scan(cursor, match=match, count=_SCAN_COUNT, _type=type_)

    async def _redis_remove_backend(self, backend: str) -> int:
        n = 0
        cursor = 0
        while True:
            cursor, keys = await self._scan(self._zset_match, "zset", cursor)
            if keys:
                cmds: list[tuple[Any, ...]] = []
                for k in keys:
                    cmds.append((b"ZREM", k, backend))
                    cmds.append((b"HDEL", k + b":t", backend))
                res = await self._transaction(cmds)
                n += sum(res[0::2])
            if cursor == 0:
                break
        self._stats_cache = None
        return n

    async def _redis_clear(self) -> int:
        n = 0
        cursor = 0
        while True:
            cursor, keys = await self._scan(self._zset_match, "zset", cursor)
            if keys:
                cmds: list[tuple[Any, ...]] = []
                for k in keys:
                    cmds.append((b"ZCARD", k))
                    cmds.append((b"UNLINK", k, k + b":t"))
                res = await self._transaction(cmds)
                n += sum(res[0::2])
            if cursor == 0:
                break
        # Leftovers of any type (a hash whose set vanished, foreign keys in our namespace).
        cursor = 0
        while True:
            cursor, keys = await self._scan(self._zset_match, None, cursor)
            if keys:
                await self._redis.unlink(*keys)
            if cursor == 0:
                break
        self._stats_cache = None
        return n

    async def _redis_counts(self) -> tuple[int, int]:
        cached = self._stats_cache
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._stats_cache_s:
            return cached[1], cached[2]
        prefixes = entries = 0
        cursor = 0
        while True:
            cursor, keys = await self._scan(self._zset_match, "zset", cursor)
            if keys:
                prefixes += len(keys)
                res = await self._roundtrip([(b"ZCARD", k) for k in keys])
                entries += sum(res)
            if cursor == 0:
                break
        self._stats_cache = (now, prefixes, entries)
        return prefixes, entries

    async def _redis_sweep(self) -> int:
        n = 0
        seen = 0
        cursor = self._sweep_cursor
        now_ms = self._now_ms()
        while True:
            cursor, keys = await self._scan(self._hash_match, "hash", cursor)
            if keys:
                seen += len(keys)
                metas = await self._roundtrip([(b"HGETALL", k) for k in keys])
                for tkey, meta in zip(keys, metas, strict=True):
                    if not isinstance(meta, dict):
                        meta = dict(zip(meta[::2], meta[1::2], strict=True))
                    args: list[bytes] = []
                    for field, value in meta.items():
                        if _expiry_ms(value) <= now_ms:
                            args += (field, value)
                    if args:
                        removed = await self._prune_script(keys=[tkey[:-2], tkey], args=args)
                        n += int(removed)
            if cursor == 0 or seen >= self._sweep_keys:
                break
        self._sweep_cursor = cursor
        self._expired += n
        if n:
            self._stats_cache = None
        return n
