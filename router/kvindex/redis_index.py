"""Redis KV index: shared by every router instance.

Layout, per key (``<kp>`` is the key prefix, ``cr:kvidx:`` by default, ``cr:kvchain:`` for
the chain index; a prefix hash names itself, a 16-byte chain key by its 32 hex characters)::

    <kp><key>     sorted set   member = backend, score = token_count
    <kp><key>:t   hash         field  = backend, value = <tier><expires_at_ms>

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
anyway, and the member stays the backend name the seed specifies.

Generations: a resync replaces all of a backend's entries, and every router sharing the
index must see the old state or the new one, never a half-built one (a SCAN deleting as
it goes showed the backend empty to everybody, for as long as the snapshot took). So a
backend's entries belong to a generation, and members carry it: ``backend`` for generation
0 (a backend never resynced; the seed's layout), ``backend@<gen>`` after that::

    <kp>#gens     hash     field = backend, value = its current generation (absent: 0)
    <kp>#seq      string   generation counter (INCR), never reset, not even by clear()

Readers fetch ``#gens`` with every query (in the same pipeline or script) and ignore
members of any other generation; writers' scripts resolve the current generation the same
way. A resync (``begin_resync``) takes a fresh generation from ``#seq`` and writes the
snapshot there, invisible; ``end_resync`` makes it current with one script (only if it is
newer than the current one: two routers resyncing at once converge on the newer), then
reclaims the replaced generation's members by SCAN, which nobody sees any more. A router
killed mid-resync leaves only invisible members, which expire by TTL. ``remove_backend`` is
the same swap to an empty generation.

Operations, one round trip each:

* query: the query_many script (below) for one key, ``EVALSHA`` sent on one pooled
  connection (one bulk string to parse, not three replies); expired entries and other
  generations' members are filtered client-side and never returned; a line that does not
  parse is read again as ``ZREVRANGEBYSCORE``, ``HGETALL key:t`` and ``HGETALL #gens``
  pipelined;
* query_many: one read-only script doing the same two reads per key and returning them
  as ONE string (``member score ...|field value ...`` per key, a line each, after the
  generation hash's line). redis-py's pure-Python reply parser costs about 12 us per
  reply element, so 64 keys pipelined as 128 commands cost the router ~2.7 ms of CPU;
  the script's single bulk string costs ~0.4 ms in all, for ~0.2 ms of Redis time
  (``bench/kvindex_bench.py``). Members are backend names (``[A-Za-z0-9_.-]``, with
  ``@<gen>``), so the separators are unambiguous; a line that does not parse (a foreign
  tool's member) is read again with the pipelined commands;
* upsert, remove, write_many, restore: the one write script (resolving the generation);
* set_tier: a short script (change the tier only if the member exists and is live);
* write_many: one script call per ``write_batch`` (256) upserts and removes; with a ``ttl``
  (predictions; upsert with a ttl too) the same script leaves an entry alone whose expiry
  is after the new one, and raises a key's PEXPIRE only when it would grow (PTTL
  first), so a prediction never shortens an entry or the key around it;
* restore (a fallback's state replayed after an outage): one script call per 128 entries;
* reclaiming a generation / clear / stats / cleanup_expired: ``SCAN`` over the key prefix
  with a TYPE filter, never ``KEYS``, then one script per page (per slot on a Cluster) to
  reclaim or clear; these are rare (resync, admin, a periodic sweep).
  ``stats`` counts the members of generations not reclaimed yet too.

Expired entries inside a live prefix are hidden on read and removed by ``cleanup_expired``,
which sweeps up to ``sweep_keys`` hashes per call, resuming its SCAN cursor next time, and
deletes a field only if it still holds the value it read (compare-and-delete script), so a
concurrent refresh by another instance is never lost.

Failures: a connection error, timeout, read-only replica, OOM or loading Redis
(``router.redis.UNAVAILABLE_ERRORS``) raises :class:`KvIndexUnavailable`; this index talks
to Redis only. :class:`~router.kvindex.fallback.FallbackKvIndex` puts a memory index behind
it and uses :meth:`RedisKvIndex.ping` and :meth:`RedisKvIndex.restore` to come back.

Size: the module stays whole (about 1000 lines) because the key layout, the Lua scripts
that encode it and the commands reading it must change together.

Clocks: expiries are Unix time on Redis's own clock by default
(``router.kvindex.server_clock``: ``TIME`` read before every sweep, advanced by the
monotonic clock in between), so a router whose wall clock steps forward never deletes the
fleet's live entries.

Redis Cluster (the client is a ``RedisCluster``): a script or pipeline may only touch keys
of one hash slot, and the layout above puts every backend of a prefix in one sorted set
and every generation in one hash. So on a Cluster each backend has keys of its own, all
under the hash tag ``{<kp><backend>}`` (one slot per backend)::

    {<kp><backend>}<key>     sorted set   member = backend[@gen], score = token_count
    {<kp><backend>}<key>:t   hash         field  = backend[@gen], value = <tier><expiry>
    {<kp><backend>}#gens     hash         field  = backend, value = its current generation
    <kp>#seq                 string       generation counter (one key: any slot)
    <kp>#backends            set          the backends written, so readers know whom to ask

Same members, values and scripts as above: a "key group" is the namespace (``<kp>``, one
group) on one server and a backend's tag on a Cluster, and every script gets the keys of
one group, its ``#gens`` first. Writes are split by group (one script call per backend in
a batch, run concurrently, each atomic); a query asks every backend of ``#backends`` (one
script call per backend, concurrently: one round trip of wall time) and merges the lines.
Readers re-read ``#backends`` every ``backends_refresh_s`` (1 s) and writers re-add their
backends every 10 s, so a backend written by another router for the first time shows up
within a second; ``remove_backend`` takes it out (a router still writing it re-adds it).
``clear`` keeps ``#backends`` like ``#seq``. The scans (reclaim, clear, stats, sweep) walk
every primary (``router.redis.keyspace``) and send their per-page scripts one per slot.
A backend's index lives on the node of its slot: with few backends and many primaries the
nodes hold unequal shares. The standalone/Sentinel layout is unchanged (the seed's
``cr:kvidx:<hash>`` sets, read by other tools).
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import RedisCluster

from router.redis import UNAVAILABLE_ERRORS, RedisClient, close_client, glob_escape, send_by_node
from router.redis.keyspace import SCAN_START, ScanPos, scan_pages, scan_step, unlink

from .base import (
    EMPTY,
    Change,
    IndexEntry,
    IndexStats,
    Key,
    KvIndex,
    KvIndexError,
    KvIndexUnavailable,
    StorageTier,
    check_ttl,
)
from .server_clock import ServerClock

__all__ = ["DEFAULT_KEY_PREFIX", "RedisKvIndex", "Restore"]

DEFAULT_KEY_PREFIX = "cr:kvidx:"

log = logging.getLogger(__name__)

Restore = tuple[Key, str, int, "StorageTier | None", float]
"""``(prefix_hash, backend, token_count, tier, ttl_left_s)`` for :meth:`RedisKvIndex.restore`:
write the entry so that it expires ``ttl_left_s`` from now, or with tier None remove it
(``token_count`` and ``ttl_left_s`` are then ignored)."""


_TIER_CODE = {StorageTier.GPU_HOT: b"g", StorageTier.STORAGE_WARM: b"s"}
_CODE_TIER = {ord("g"): StorageTier.GPU_HOT, ord("s"): StorageTier.STORAGE_WARM}
_MAX_NAMES = 4096
_SCAN_COUNT = 500
_REPLAY_CHUNK = 128

# KEYS: generation hash, zset, hash. ARGV: backend, generation ('' = current), new hash
# value, ttl_ms, now_ms.
_SET_TIER_LUA = """
local gen = ARGV[2]
if gen == '' then gen = redis.call('HGET', KEYS[1], ARGV[1]) or '0' end
local member = ARGV[1]
if gen ~= '0' then member = member .. '@' .. gen end
if not redis.call('ZSCORE', KEYS[2], member) then return 0 end
local v = redis.call('HGET', KEYS[3], member)
local e = v and tonumber(string.sub(v, 2))
if e and e <= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', KEYS[3], member, ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return 1
"""

# KEYS: generation hash. ARGV: backend, generation. Makes the generation the backend's
# current one if it is newer than the current one; returns the generation whose members
# are garbage now (the replaced one, or the given one when a newer one won).
_SWAP_LUA = """
local cur = redis.call('HGET', KEYS[1], ARGV[1]) or '0'
if tonumber(ARGV[2]) > tonumber(cur) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return cur
end
return ARGV[2]
"""

# KEYS: the generation hash, then zset and hash of each change, in order. ARGV: ttl_ms,
# now_ms, new_expiry_ms (0: events), then per change: op (u = upsert, r = remove), backend,
# generation ('' = the backend's current one, read from KEYS[1]), token_count, hash value.
# Every write of the index (upsert, remove, write_many, restore) is this script; returns
# {removed, expired}: how many removes found their entry, and how many of those had already
# expired. With a new_expiry (predictions), an upsert skips a member whose recorded expiry
# is after it (or that has no readable one: not ours to date), and a key's PEXPIRE only
# grows.
_WRITE_MANY_LUA = """
local ttl, now, exp = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local removed, expired, gens = 0, 0, {}
for i = 1, (#KEYS - 1) / 2 do
  local key, tkey, a = KEYS[2 * i], KEYS[2 * i + 1], 5 * i - 1
  local backend, gen = ARGV[a + 1], ARGV[a + 2]
  if gen == '' then
    gen = gens[backend]
    if not gen then
      gen = redis.call('HGET', KEYS[1], backend) or '0'
      gens[backend] = gen
    end
  end
  local member = backend
  if gen ~= '0' then member = backend .. '@' .. gen end
  if ARGV[a] == 'u' then
    local write = true
    if exp > 0 and redis.call('ZSCORE', key, member) then
      local v = redis.call('HGET', tkey, member)
      local e = v and tonumber(string.sub(v, 2))
      write = (e and e <= exp) or false
    end
    if write then
      redis.call('ZADD', key, ARGV[a + 3], member)
      redis.call('HSET', tkey, member, ARGV[a + 4])
      if exp == 0 then
        redis.call('PEXPIRE', key, ttl)
        redis.call('PEXPIRE', tkey, ttl)
      else
        if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
        if redis.call('PTTL', tkey) < ttl then redis.call('PEXPIRE', tkey, ttl) end
      end
    end
  else
    local v = redis.call('HGET', tkey, member)
    if redis.call('ZREM', key, member) == 1 then
      removed = removed + 1
      if v and tonumber(string.sub(v, 2)) <= now then expired = expired + 1 end
    end
    redis.call('HDEL', tkey, member)
  end
end
return {removed, expired}
"""
# KEYS: the generation hash, then zset and hash of each key. Returns one string, a line
# per key after a first line with the generation hash ("<backend> <gen> ..."), joined by
# LF: "<member> <score> ...|<field> <value> ...", or an empty line when the key has no
# member.
_QUERY_MANY_LUA = """
local out = {table.concat(redis.call('HGETALL', KEYS[1]), ' ')}
for i = 2, #KEYS, 2 do
  local z = redis.call('ZREVRANGEBYSCORE', KEYS[i], '+inf', '-inf', 'WITHSCORES')
  if #z == 0 then
    out[#out + 1] = ''
  else
    local h = redis.call('HGETALL', KEYS[i + 1])
    out[#out + 1] = table.concat(z, ' ') .. '|' .. table.concat(h, ' ')
  end
end
return table.concat(out, '\\n')
"""
_QUERY_BATCH = 512
"""Keys per ``query_many`` script call (about 2 ms of Redis time at the most)."""
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

# KEYS: zset, hash of each key (one page of a SCAN, one slot). ARGV: member. Deletes the
# member from every key (a replaced generation); returns how many sets held it.
_RECLAIM_LUA = """
local n = 0
for i = 1, #KEYS, 2 do
  n = n + redis.call('ZREM', KEYS[i], ARGV[1])
  redis.call('HDEL', KEYS[i + 1], ARGV[1])
end
return n
"""

# KEYS: zset, hash of each key (one page of a SCAN, one slot). Unlinks both; returns how
# many members the sets held (atomic, so the count is what was deleted).
_CLEAR_LUA = """
local n = 0
for i = 1, #KEYS, 2 do
  n = n + redis.call('ZCARD', KEYS[i])
  redis.call('UNLINK', KEYS[i], KEYS[i + 1])
end
return n
"""
_BACKENDS_REFRESH_S = 1.0
"""How long a reader (on a Cluster) trusts its list of backends before re-reading it."""
_REREGISTER_S = 10.0
"""How often a writer (on a Cluster) re-adds the backends it writes to ``#backends``."""


def _as_dict(reply: Any) -> dict[bytes, bytes]:
    """A HGETALL reply (RESP3 map or RESP2 flat list) as a dict."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


def _expiry_ms(value: bytes) -> float:
    """Expiry of a hash value ``<tier><ms>``; ``inf`` for a value we did not write."""
    try:
        return int(value[1:])
    except ValueError:
        return math.inf


async def _all(calls: Iterable[Any]) -> list[Any]:
    """Await ``calls`` concurrently, every one to its end; their results in order, or the
    first failure raised once all are done (none left running behind a fallback switch)."""
    tasks = list(calls)
    if len(tasks) == 1:
        return [await tasks[0]]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class _Batch:
    """The write script calls of one batch of changes: one per key group (the namespace
    on one server, a backend on a Cluster), each ``(keys, args)`` starting with the
    group's ``#gens`` and the shared ``head`` arguments (ttl_ms, now_ms, new_expiry_ms)."""

    __slots__ = ("backends", "calls", "head", "size")

    def __init__(self, ttl_ms: int, now_ms: int, expiry_ms: int) -> None:
        self.head = (ttl_ms, now_ms, expiry_ms)
        self.calls: dict[bytes, tuple[list[bytes], list[Any]]] = {}
        self.backends: set[str] = set()
        self.size = 0


class RedisKvIndex(KvIndex):
    """KV index in Redis sorted sets; raises :class:`KvIndexUnavailable` while Redis is
    unusable (wrap it in ``FallbackKvIndex`` to be served from memory instead)."""

    kind = "redis"
    write_batch = _WRITE_BATCH
    """Changes per ``write_many`` script call (a caller that must know which of its changes
    reached Redis when one call fails hands over this many at a time)."""

    def __init__(
        self,
        redis: RedisClient,
        ttl_seconds: float = 600.0,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        clock: Callable[[], float] | None = None,
        sweep_keys: int = 10_000,
        stats_cache_s: float = 10.0,
        backends_refresh_s: float = _BACKENDS_REFRESH_S,
        owns_redis: bool = False,
    ) -> None:
        """
        Args:
            redis: a client whose pool may be shared (``RedisPools``); never closed here.
                A ``RedisCluster`` selects the Cluster layout (module docstring).
            ttl_seconds: an entry expires this long after its last event.
            key_prefix: namespace of this index's keys; everything under it is ours.
            clock: Unix seconds; per-entry expiries are on this clock. Default: Redis's
                own (:class:`~router.kvindex.server_clock.ServerClock`, synced before
                every sweep), so no router's wall clock decides what the fleet deletes.
            sweep_keys: hashes examined per ``cleanup_expired`` call.
            stats_cache_s: how long ``stats()`` reuses its SCAN counts.
            backends_refresh_s: on a Cluster, how long a query trusts its list of the
                backends (``#backends``) before reading it again.
            owns_redis: ``close`` also closes ``redis`` (a client nobody else uses).
        """
        if not ttl_seconds > 0:
            raise ValueError("ttl_seconds must be positive")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        self._redis = redis
        self._cluster = isinstance(redis, RedisCluster)
        if self._cluster and ("{" in key_prefix or "}" in key_prefix):
            raise ValueError("key_prefix must not contain { or } on a Redis Cluster")
        self._owns_redis = owns_redis
        self._pool = None if isinstance(redis, RedisCluster) else redis.connection_pool
        self._ttl_ms = max(1, int(ttl_seconds * 1000))
        self.key_prefix = key_prefix
        self._kp = key_prefix.encode()
        namespace = b"{" + self._kp if self._cluster else self._kp
        self._zset_match = glob_escape(namespace) + b"*"
        self._hash_match = glob_escape(namespace) + b"*:t"
        if clock is None:
            clock = ServerClock()
        self._server_clock = clock if isinstance(clock, ServerClock) else None
        self.clock: Callable[[], float] = clock
        self._sweep_keys = sweep_keys
        self._stats_cache_s = stats_cache_s
        self._seq_key = self._kp + b"#seq"
        self._backends_key = self._kp + b"#backends"
        self._backends_refresh_s = backends_refresh_s
        self._tags: dict[str, bytes] = {}
        self._known: dict[str, None] = {}
        """Cluster: the backends a query asks (``#backends`` as last read, and ours)."""
        self._known_at = -math.inf
        self._registered: dict[str, float] = {}
        """Cluster: backend -> when this instance last added it to ``#backends``."""
        self._staging: dict[str, int] = {}
        self._set_tier_script = redis.register_script(_SET_TIER_LUA)
        self._swap_script = redis.register_script(_SWAP_LUA)
        self._prune_script = redis.register_script(_PRUNE_LUA)
        self._write_many_script = redis.register_script(_WRITE_MANY_LUA)
        self._query_many_script = redis.register_script(_QUERY_MANY_LUA)
        self._reclaim_script = redis.register_script(_RECLAIM_LUA)
        self._clear_script = redis.register_script(_CLEAR_LUA)
        self._names: dict[bytes, str] = {}
        self._expired = 0
        self._stats_cache: tuple[float, int, int] | None = None
        self._sweep_pos: ScanPos = SCAN_START

    # ---- state -----------------------------------------------------------------------

    @property
    def redis(self) -> RedisClient:
        """The client this index uses (closed by ``close`` only if ``owns_redis``)."""
        return self._redis

    @property
    def total_expired(self) -> int:
        """Expired entries this process dropped (``stats().total_expired``, without I/O)."""
        return self._expired

    def forget_counts(self) -> None:
        """Make the next ``stats()`` count afresh instead of reusing its cached SCAN."""
        self._stats_cache = None

    def _unavailable(self, operation: str, exc: BaseException) -> KvIndexUnavailable:
        return KvIndexUnavailable(self.kind, operation, exc)

    # ---- key layout ------------------------------------------------------------------

    def _tag(self, backend: str) -> bytes:
        """The key group ``backend``'s keys belong to: the namespace on one server, the
        backend's hash tag ``{<kp><backend>}`` on a Cluster."""
        if not self._cluster:
            return self._kp
        tag = self._tags.get(backend)
        if tag is None:
            tag = b"{" + self._kp + backend.encode() + b"}"
            if len(self._tags) < _MAX_NAMES:
                self._tags[backend] = tag
        return tag

    @staticmethod
    def _gens_key(tag: bytes) -> bytes:
        return tag + b"#gens"

    @staticmethod
    def _key(tag: bytes, prefix_hash: Key) -> bytes:
        if type(prefix_hash) is bytes:
            return tag + binascii.hexlify(prefix_hash)
        return tag + prefix_hash.encode()  # type: ignore[union-attr]

    def _prefix_of(self, key: bytes) -> bytes:
        """A set's key without its group: the prefix it indexes (several backends' sets
        share it on a Cluster)."""
        return key[key.index(b"}") + 1 :] if self._cluster else key

    async def _query_tags(self) -> list[bytes]:
        """The key groups a query reads: the namespace, or every known backend's tag."""
        if not self._cluster:
            return [self._kp]
        now = time.monotonic()
        if now - self._known_at >= self._backends_refresh_s:
            members = await self._redis.smembers(self._backends_key)
            known = {m if isinstance(m, str) else self._name(m): None for m in members}
            known.update(dict.fromkeys(self._registered))
            self._known, self._known_at = known, now
        return [self._tag(b) for b in self._known]

    async def _register(self, backends: Iterable[str]) -> None:
        """Cluster: add the backends about to be written to ``#backends`` (again every
        ``_REREGISTER_S``, so a ``remove_backend`` elsewhere does not hide them for long)."""
        now = time.monotonic()
        due = [b for b in backends if now - self._registered.get(b, -math.inf) >= _REREGISTER_S]
        if not due:
            return
        await self._redis.sadd(self._backends_key, *due)
        for b in due:
            self._registered[b] = now
            self._known[b] = None

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def now(self) -> float:
        return self.clock()

    def _name(self, member: bytes) -> str:
        name = self._names.get(member)
        if name is None:
            name = member.decode()
            if len(self._names) < _MAX_NAMES:
                self._names[member] = name
        return name

    # ---- wire ------------------------------------------------------------------------

    async def _roundtrip(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send ``commands`` pipelined on one pooled connection and read every reply
        (one server only).

        A connection error retries once on a fresh socket (every command we pipeline is
        idempotent); any other failure drops the connection, whose unread replies would
        otherwise poison the pool.
        """
        pool = self._pool
        assert pool is not None
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

    async def _commands(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Idempotent single-key commands (key second), the replies in order: pipelined
        on one server; on a Cluster one pipeline per node (a page of a SCAN as 500 single
        commands would hold every turn of the bounded client for a while, and wait for
        them past its timeout under load), else each sent to its slot's primary."""
        if self._pool is not None:
            return await self._roundtrip(commands)
        assert isinstance(self._redis, RedisCluster)
        sent = await send_by_node(self._redis, [(c[1], c) for c in commands])
        if sent is not None:
            return sent
        return await _all(self._redis.execute_command(*c) for c in commands)

    def _slot_groups(self, keys: list[bytes]) -> list[list[bytes]]:
        """``keys`` (sets of one SCAN page) by hash slot: one group on one server."""
        if not isinstance(self._redis, RedisCluster):
            return [keys]
        by_slot: dict[int, list[bytes]] = {}
        for k in keys:
            by_slot.setdefault(self._redis.keyslot(k), []).append(k)
        return list(by_slot.values())

    def _gen(self, backend: str) -> bytes:
        """The generation a write of ``backend`` goes to: this instance's resync in
        progress, else ``b""`` (the script reads the current one)."""
        staged = self._staging.get(backend)
        return b"" if staged is None else str(staged).encode()

    def _add_change(
        self,
        batch: _Batch,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        value: bytes | None,
    ) -> None:
        """One change of the write script, into its key group's call: its two keys and
        five arguments (``value``, the hash's ``<tier><expiry>``, None for a remove)."""
        tag = self._tag(backend)
        call = batch.calls.get(tag)
        if call is None:
            call = batch.calls[tag] = ([self._gens_key(tag)], list(batch.head))
        if self._cluster:
            batch.backends.add(backend)
        keys, args = call
        key = self._key(tag, prefix_hash)
        keys += (key, key + b":t")
        batch.size += 1
        if value is None:
            args += (b"r", backend, self._gen(backend), 0, b"")
        else:
            args += (b"u", backend, self._gen(backend), token_count, value)

    async def _write(self, batch: _Batch, operation: str) -> tuple[int, int]:
        """One ``_WRITE_MANY_LUA`` call per key group, concurrently: ``(removed, expired)``
        summed."""
        try:
            if self._cluster:
                await self._register(batch.backends)
            replies = await _all(
                self._write_many_script(keys=keys, args=args) for keys, args in batch.calls.values()
            )
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable(operation, exc) from exc
        return sum(int(r[0]) for r in replies), sum(int(r[1]) for r in replies)

    async def _generations(self, tag: bytes) -> dict[bytes, bytes]:
        return _as_dict(await self._redis.hgetall(self._gens_key(tag)))

    def _decode(self, zreply: Any, hreply: Any, greply: Any) -> Sequence[IndexEntry]:
        if not zreply:
            return EMPTY
        gens = _as_dict(greply)
        if isinstance(hreply, dict):  # RESP3 map
            meta = hreply
        else:  # RESP2 flat list
            meta = dict(zip(hreply[::2], hreply[1::2], strict=True))
        if isinstance(zreply[0], list):  # RESP3: [[member, score], ...]
            pairs: Any = zreply
        else:  # RESP2: [member, score, member, score, ...]
            pairs = zip(zreply[::2], zreply[1::2], strict=True)
        return self._entries(pairs, meta, self._now_ms(), gens)

    def _decode_line(
        self, line: bytes, now_ms: int, gens: dict[bytes, bytes]
    ) -> Sequence[IndexEntry] | None:
        """One line of the query_many script's reply; None if it does not parse."""
        if not line:
            return EMPTY
        z, _, h = line.partition(b"|")
        zs = z.split(b" ")
        hs = h.split(b" ") if h else []
        if len(zs) % 2 or len(hs) % 2:
            return None
        try:
            meta = dict(zip(hs[::2], hs[1::2], strict=True))
            return self._entries(zip(zs[::2], zs[1::2], strict=True), meta, now_ms, gens)
        except ValueError:  # a score that is not a number
            return None

    def _entries(
        self, pairs: Any, meta: Any, now_ms: int, gens: dict[bytes, bytes]
    ) -> Sequence[IndexEntry]:
        out: list[IndexEntry] = []
        for member, score in pairs:
            name, at, gen = member.partition(b"@")
            if gens.get(name, b"0") != (gen if at else b"0"):
                continue  # another generation: a resync in progress, or not yet reclaimed
            value = meta.get(member)
            if value is None:  # written by a foreign tool: GpuHot, the key TTL bounds it
                tier, exp = StorageTier.GPU_HOT, float(now_ms + self._ttl_ms)
            else:
                exp = _expiry_ms(value)
                if exp <= now_ms:
                    continue
                if exp == math.inf:  # not our format: bounded by the key TTL
                    exp = now_ms + self._ttl_ms
                tier = (
                    _CODE_TIER.get(value[0], StorageTier.GPU_HOT) if value else StorageTier.GPU_HOT
                )
            out.append(IndexEntry(self._name(name), int(float(score)), tier, exp / 1000.0))
        if not out:
            return EMPTY
        return tuple(out)

    # ---- KvIndex ---------------------------------------------------------------------

    async def query_backends(self, prefix_hash: Key) -> Sequence[IndexEntry]:
        """The query_many script for one key. On one server it is sent on a pooled
        connection: one bulk string to parse instead of the three replies (and their
        elements) of the commands. On a Cluster, one call per backend, concurrently."""
        if self._cluster:
            return (await self.query_many((prefix_hash,)))[0]
        tag = self._kp
        key = self._key(tag, prefix_hash)
        rkeys = (self._gens_key(tag), key, key + b":t")
        try:
            try:
                (blob,) = await self._roundtrip(
                    ((b"EVALSHA", self._query_many_script.sha, 3, *rkeys),)
                )
            except rx.NoScriptError:  # a new primary (failover) or a flushed script cache
                blob = await self._query_many_script(keys=rkeys)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("query", exc) from exc
        head, _, line = blob.partition(b"\n")
        g = head.split(b" ") if head else []
        got = self._decode_line(line, self._now_ms(), dict(zip(g[::2], g[1::2], strict=False)))
        return got if got is not None else await self._query_commands(tag, key)

    async def _query_commands(self, tag: bytes, key: bytes) -> Sequence[IndexEntry]:
        """The query as plain commands: what reads a member the script's line cannot
        carry (a foreign tool's)."""
        try:
            zreply, hreply, greply = await self._commands(
                (
                    ("ZREVRANGEBYSCORE", key, b"+inf", b"-inf", b"WITHSCORES"),
                    ("HGETALL", key + b":t"),
                    ("HGETALL", self._gens_key(tag)),
                )
            )
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("query", exc) from exc
        return self._decode(zreply, hreply, greply)

    async def query_many(self, keys: Sequence[Key]) -> list[Sequence[IndexEntry]]:
        """One script call per ``_QUERY_BATCH`` keys (one round trip for any prompt up to
        512 chunks, some 128k tokens; a longer one does not block Redis in one go) and
        key group: on a Cluster one per backend, concurrently, merged by token count."""
        out: list[Sequence[IndexEntry]] = []
        try:
            tags = await self._query_tags()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("query", exc) from exc
        if not tags:
            return [EMPTY] * len(keys)
        for start in range(0, len(keys), _QUERY_BATCH):
            part = keys[start : start + _QUERY_BATCH]
            rkeys = [self._group_keys(tag, part) for tag in tags]
            try:
                blobs = await self._query_blobs(rkeys)
            except UNAVAILABLE_ERRORS as exc:
                raise self._unavailable("query", exc) from exc
            per_group = [
                await self._parse_group(tag, part, blob)
                for tag, blob in zip(tags, blobs, strict=True)
            ]
            if len(per_group) == 1:
                out += per_group[0]
                continue
            for found in zip(*per_group, strict=True):
                live = [g for g in found if g]
                if len(live) <= 1:
                    out.append(live[0] if live else EMPTY)
                else:
                    merged = [e for g in live for e in g]
                    merged.sort(key=lambda e: (e.token_count, e.backend), reverse=True)
                    out.append(tuple(merged))
        return out

    def _group_keys(self, tag: bytes, part: Sequence[Key]) -> list[bytes]:
        """The query_many script's keys over ``part`` in one key group."""
        rkeys: list[bytes] = [self._gens_key(tag)]
        for k in part:
            key = self._key(tag, k)
            rkeys += (key, key + b":t")
        return rkeys

    async def _query_blobs(self, groups: list[list[bytes]]) -> list[bytes]:
        """The query_many script's reply for each group of keys. On a Cluster, first as
        one pipeline per node (``send_by_node``); if that meets anything unusual, one call
        per group through the client, which follows redirects and loads the script."""
        if isinstance(self._redis, RedisCluster):
            sha = self._query_many_script.sha
            sent = await send_by_node(
                self._redis, [(g[0], ("EVALSHA", sha, len(g), *g)) for g in groups]
            )
            if sent is not None:
                return sent
        return await _all(self._query_many_script(keys=g) for g in groups)

    async def _parse_group(
        self, tag: bytes, part: Sequence[Key], blob: bytes
    ) -> list[Sequence[IndexEntry]]:
        """The lines of one group's query_many reply, as entries."""
        lines = blob.split(b"\n")
        if len(lines) != len(part) + 1:
            raise KvIndexError(f"query_many: {len(lines)} lines for {len(part)} keys")
        g = lines[0].split(b" ") if lines[0] else []
        gens = dict(zip(g[::2], g[1::2], strict=False))
        now_ms = self._now_ms()
        out: list[Sequence[IndexEntry]] = []
        for k, line in zip(part, lines[1:], strict=True):
            got = self._decode_line(line, now_ms, gens)
            if got is None:
                got = await self._query_commands(tag, self._key(tag, k))
            out.append(got)
        return out

    async def backend_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        gens_of: dict[bytes, dict[bytes, bytes]] = {}
        try:
            async for keys in scan_pages(self._redis, self._zset_match, _SCAN_COUNT, "zset"):
                if not keys:
                    continue
                replies = await self._commands(tuple(("ZRANGE", k, 0, -1) for k in keys))
                for key, members in zip(keys, replies, strict=True):
                    tag = key[: key.index(b"}") + 1] if self._cluster else self._kp
                    gens = gens_of.get(tag)
                    if gens is None:
                        gens = gens_of[tag] = await self._generations(tag)
                    for m in members:
                        raw, at, gen = m.partition(b"@")
                        if gens.get(raw, b"0") != (gen if at else b"0"):
                            continue
                        name = self._name(raw)
                        counts[name] = counts.get(name, 0) + 1
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("backend_counts", exc) from exc
        return counts

    async def upsert(
        self,
        prefix_hash: Key,
        backend: str,
        token_count: int,
        tier: StorageTier,
        ttl: float | None = None,
    ) -> None:
        if token_count < 0:
            raise ValueError("token_count must be non-negative")
        if ttl is not None:  # a prediction: the write_many script's conditional upsert
            await self.write_many([(prefix_hash, backend, token_count, tier)], ttl)
            return
        now_ms = self._now_ms()
        batch = _Batch(self._ttl_ms, now_ms, 0)
        value = _TIER_CODE[tier] + str(now_ms + self._ttl_ms).encode()
        self._add_change(batch, prefix_hash, backend, token_count, value)
        await self._write(batch, "upsert")

    async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
        """One script call per ``write_batch`` changes instead of a MULTI/EXEC each: the
        consumer's cost per event in Redis mode was redis-py's per-command packing and
        reply reading (about 230 us of CPU per upsert), not Redis. Each call is atomic,
        like a single upsert or remove; the calls before a failing one stay applied."""
        check_ttl(ttl)
        for _, _, token_count, tier in changes:
            if tier is not None and token_count < 0:
                raise ValueError("token_count must be non-negative")
        ttl_ms = self._ttl_ms if ttl is None else max(1, min(int(ttl * 1000), self._ttl_ms))
        for start in range(0, len(changes), _WRITE_BATCH):
            part = changes[start : start + _WRITE_BATCH]
            now_ms = self._now_ms()
            value_tail = str(now_ms + ttl_ms).encode()
            batch = _Batch(ttl_ms, now_ms, 0 if ttl is None else now_ms + ttl_ms)
            for prefix_hash, backend, token_count, tier in part:
                value = None if tier is None else _TIER_CODE[tier] + value_tail
                self._add_change(batch, prefix_hash, backend, token_count, value)
            self._expired += (await self._write(batch, "write_many"))[1]

    async def set_tier(self, prefix_hash: Key, backend: str, tier: StorageTier) -> bool:
        tag = self._tag(backend)
        key = self._key(tag, prefix_hash)
        now_ms = self._now_ms()
        value = _TIER_CODE[tier] + str(now_ms + self._ttl_ms).encode()
        try:
            done = await self._set_tier_script(
                keys=[self._gens_key(tag), key, key + b":t"],
                args=[backend, self._gen(backend), value, self._ttl_ms, now_ms],
            )
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("set_tier", exc) from exc
        return bool(done)

    async def remove(self, prefix_hash: Key, backend: str) -> bool:
        batch = _Batch(self._ttl_ms, self._now_ms(), 0)
        self._add_change(batch, prefix_hash, backend, 0, None)
        removed, expired = await self._write(batch, "remove")
        self._expired += expired
        return removed > expired

    async def remove_backend(self, backend: str) -> int:
        """A swap to a new, empty generation: every router sees the backend empty at once
        (not key by key as a SCAN goes), then the old generation is reclaimed."""
        staged = self._staging.pop(backend, None)
        try:
            gen = int(await self._redis.incr(self._seq_key))
            garbage = await self._swap(backend, gen)
            n = await self._reclaim(backend, garbage)
            if staged is not None:
                await self._reclaim(backend, staged)
            if self._cluster:  # queries stop asking it (a router writing it re-adds it)
                self._registered.pop(backend, None)
                self._known.pop(backend, None)
                await self._redis.srem(self._backends_key, backend)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("remove_backend", exc) from exc
        return n

    async def begin_resync(self, backend: str) -> None:
        """Start a new generation of ``backend``: this instance's writes of it go there,
        invisible to every reader, until :meth:`end_resync` makes it the current one. A
        resync of ours still in progress (its stream dropped mid-snapshot) is reclaimed."""
        old = self._staging.pop(backend, None)
        try:
            self._staging[backend] = int(await self._redis.incr(self._seq_key))
            if old is not None:
                await self._reclaim(backend, old)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("begin_resync", exc) from exc

    async def end_resync(self, backend: str) -> None:
        """Swap the generation built since :meth:`begin_resync` in, in one script: readers
        see the whole old state or the whole new one, never a part. Of two routers
        resyncing ``backend`` at once the newer generation wins and the other's is
        dropped, so they converge; the replaced generation is reclaimed afterwards (if
        that fails, its entries expire by TTL, invisible meanwhile)."""
        gen = self._staging.get(backend)
        if gen is None:
            return
        try:
            garbage = await self._swap(backend, gen)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("end_resync", exc) from exc
        del self._staging[backend]
        try:
            await self._reclaim(backend, garbage)
        except UNAVAILABLE_ERRORS as exc:
            log.warning(
                "KV index: reclaiming %s's old generation failed (%s); left to TTL", backend, exc
            )

    def discard_resync(self, backend: str) -> None:
        """Forget a resync in progress without swapping it in (Redis became unusable
        meanwhile; its entries expire by TTL, never visible)."""
        self._staging.pop(backend, None)

    async def _swap(self, backend: str, gen: int) -> int:
        """Make ``gen`` current unless a newer one is; the generation now garbage."""
        self._stats_cache = None
        return int(
            await self._swap_script(keys=[self._gens_key(self._tag(backend))], args=[backend, gen])
        )

    async def clear(self) -> int:
        try:
            return await self._redis_clear()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("clear", exc) from exc

    async def cleanup_expired(self) -> int:
        try:
            if self._server_clock is not None:
                await self._server_clock.sync(self._redis, self._seq_key)
            return await self._redis_sweep()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("cleanup_expired", exc) from exc

    async def stats(self) -> IndexStats:
        try:
            prefixes, entries = await self._redis_counts()
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("stats", exc) from exc
        return IndexStats(
            kind=self.kind,
            prefix_count=prefixes,
            entry_count=entries,
            total_hits=0,
            total_evictions=0,
            total_expired=self._expired,
        )

    async def close(self) -> None:
        """Close the client only if ``owns_redis``. Idempotent."""
        if self._owns_redis:
            self._owns_redis = False
            await close_client(self._redis)

    # ---- recovery (used by FallbackKvIndex) -------------------------------------------

    async def ping(self) -> None:
        """Raises :class:`KvIndexUnavailable` unless Redis answers: on a Cluster every
        primary (one node answering proves little: the fallback would switch back, meet
        the dead primary's slots and switch again, once per check, until its replica is
        promoted)."""
        try:
            if isinstance(self._redis, RedisCluster):
                await self._redis.execute_command("PING", target_nodes=RedisCluster.PRIMARIES)
            else:
                await self._redis.ping()
            if self._server_clock is not None and not self._server_clock.synced:
                await self._server_clock.sync(self._redis, self._seq_key)
        except UNAVAILABLE_ERRORS as exc:
            raise self._unavailable("ping", exc) from exc

    async def restore(self, items: Iterable[Restore]) -> None:
        """Write each entry with the lifetime it has left, or remove it (see :data:`Restore`):
        another store's state carried into Redis, e.g. a fallback's after an outage.

        ``_REPLAY_CHUNK`` items per write (one script call per key group). ``items`` is
        consumed lazily, one chunk at a time, so a generator reads its store as late as
        possible. Not atomic as
        a whole: if it raises, any prefix of the chunks may have been applied.
        """
        now_ms = self._now_ms()
        batch = _Batch(self._ttl_ms, now_ms, 0)
        for prefix_hash, backend, token_count, tier, ttl_left_s in items:
            value = None
            if tier is not None:
                value = _TIER_CODE[tier] + str(now_ms + int(ttl_left_s * 1000)).encode()
            self._add_change(batch, prefix_hash, backend, token_count, value)
            if batch.size >= _REPLAY_CHUNK:
                await self._write(batch, "restore")
                batch = _Batch(self._ttl_ms, now_ms, 0)
        if batch.size:
            await self._write(batch, "restore")

    # ---- scans (rare: resync, admin, sweep) -------------------------------------------

    def _scan_match(self, backend: str | None = None) -> bytes:
        """The SCAN pattern of the sets: all, or (on a Cluster) one backend's."""
        if backend is None or not self._cluster:
            return self._zset_match
        return glob_escape(self._tag(backend)) + b"*"

    @staticmethod
    def _pairs(keys: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for k in keys:
            out += (k, k + b":t")
        return out

    async def _reclaim(self, backend: str, gen: int) -> int:
        """Delete the members of ``backend``'s generation ``gen`` (readers no longer see
        them, so this need not be atomic); how many there were."""
        member = backend if gen == 0 else f"{backend}@{gen}"
        n = 0
        async for keys in scan_pages(self._redis, self._scan_match(backend), _SCAN_COUNT, "zset"):
            if keys:
                got = await _all(
                    self._reclaim_script(keys=self._pairs(group), args=[member])
                    for group in self._slot_groups(keys)
                )
                n += sum(int(x) for x in got)
        self._stats_cache = None
        return n

    async def _redis_clear(self) -> int:
        n = 0
        async for keys in scan_pages(self._redis, self._zset_match, _SCAN_COUNT, "zset"):
            if keys:
                got = await _all(
                    self._clear_script(keys=self._pairs(group)) for group in self._slot_groups(keys)
                )
                n += sum(int(x) for x in got)
        # Leftovers of any type (a hash whose set vanished, foreign keys in our namespace).
        # Generation numbers never repeat (#seq stays); nor does the list of backends go,
        # which other routers may not re-add for a while.
        keep = (self._seq_key, self._backends_key)
        async for keys in scan_pages(self._redis, self._zset_match, _SCAN_COUNT):
            keys = [k for k in keys if k not in keep]
            if keys:
                await unlink(self._redis, keys)
        self._stats_cache = None
        return n

    async def _redis_counts(self) -> tuple[int, int]:
        cached = self._stats_cache
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._stats_cache_s:
            return cached[1], cached[2]
        prefixes = entries = 0
        # On a Cluster a prefix has a set per backend: count the distinct ones.
        seen: set[bytes] | None = set() if self._cluster else None
        async for keys in scan_pages(self._redis, self._zset_match, _SCAN_COUNT, "zset"):
            if keys:
                if seen is None:
                    prefixes += len(keys)
                else:
                    seen.update(self._prefix_of(k) for k in keys)
                res = await self._commands([("ZCARD", k) for k in keys])
                entries += sum(res)
        if seen is not None:
            prefixes = len(seen)
        self._stats_cache = (now, prefixes, entries)
        return prefixes, entries

    async def _redis_sweep(self) -> int:
        n = 0
        seen = 0
        pos: ScanPos | None = self._sweep_pos
        now_ms = self._now_ms()
        while pos is not None:
            pos, keys = await scan_step(self._redis, pos, self._hash_match, _SCAN_COUNT, "hash")
            if keys:
                seen += len(keys)
                metas = await self._commands([("HGETALL", k) for k in keys])
                for tkey, meta in zip(keys, metas, strict=True):
                    args: list[bytes] = []
                    for field, value in _as_dict(meta).items():
                        if _expiry_ms(value) <= now_ms:
                            args += (field, value)
                    if args:
                        removed = await self._prune_script(keys=[tkey[:-2], tkey], args=args)
                        n += int(removed)
            if seen >= self._sweep_keys:
                break
        self._sweep_pos = pos if pos is not None else SCAN_START
        self._expired += n
        if n:
            self._stats_cache = None
        return n
