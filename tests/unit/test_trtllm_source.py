"""TrtllmPoller against a fake trtllm-serve: a real aiohttp server on loopback.

The fake serves ``POST /kv_cache_events`` the way trtllm-serve does (listener/ENGINE_FORMATS.md §7):
a JSON array of every queued event, removed from the queue on read; an idle poll blocks
(older builds wait ~2 s; here it wakes as soon as the test queues events). Event bodies follow
``KVCacheEventSerializer``: uint64 hashes written as exact JSON integers above 2**63, and the
KVCacheManagerV2 form with ``hash_algo: v2_sha256`` and 64-hex-char hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from bus.backoff import NoBackoff
from listener.engine_events import BlockHash, BlockRemoved, BlockStored, EventBatch
from listener.trtllm_source import TrtllmPoller, TrtllmPollerConfig, map_event
from listener.zmq_source import PublisherNotAllowedError
from tests import waiting

TIMEOUT = 5.0
BIG = (1 << 64) - 1  # the largest uint64
BIG2 = (1 << 63) + 5
SALT = "tenant-42-salt-do-not-log"
V2_HASH = "9f" * 32
V2_PARENT = "0a" * 32


# --------------------------------------------------------------------------------------------
# The fake trtllm-serve


class FakeTrtllmServe:
    def __init__(self) -> None:
        self.queue: list[str] = []
        self.requests = 0
        self.fail_next = 0
        self.idle_block_s = 2.0
        self._wake = asyncio.Event()
        self._closing = False
        self.runner: web.AppRunner | None = None
        self.base = ""

    def push(self, *events: dict[str, Any]) -> None:
        self.push_raw(*(json.dumps(e) for e in events))

    def push_raw(self, *events: str) -> None:
        self.queue.extend(events)
        self._wake.set()

    async def kv_cache_events(self, request: web.Request) -> web.Response:
        self.requests += 1
        assert request.method == "POST" and await request.read() == b""
        if not self.queue and not self._closing:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.idle_block_s)
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=500, text="engine error")
        events, self.queue = self.queue, []
        body = "[" + ", ".join(events) + "]"
        return web.Response(text=body, content_type="application/json")

    async def moved(self, request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/kv_cache_events")

    async def not_json_array(self, request: web.Request) -> web.Response:
        return web.json_response({"error": "not an array"})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/kv_cache_events", self.kv_cache_events)
        app.router.add_post("/moved", self.moved)
        app.router.add_post("/object", self.not_json_array)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base = f"http://127.0.0.1:{port}"
        return self.base

    async def stop(self) -> None:
        self._closing = True
        self._wake.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def serve() -> AsyncIterator[FakeTrtllmServe]:
    fake = FakeTrtllmServe()
    await fake.start()
    yield fake
    await fake.stop()


# --------------------------------------------------------------------------------------------
# Event builders (KVCacheEventSerializer's shapes)


def block(h: int | str, tokens: list[int], *, level: int = 0, salt: str | None = None) -> dict:
    return {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": level,
        "priority": 35,
        "mm_keys": [],
        "cache_salt": salt,
        "lora_id": None,
    }


def stored(
    event_id: int, blocks: list[dict], *, parent: int | str | None = None, window: int = 4096, **kw
) -> dict:
    event = {
        "event_id": event_id,
        "window_size": window,
        "data": {"type": "stored", "parent_hash": parent, "blocks": blocks},
    }
    event.update(kw)
    return event


def removed(event_id: int, hashes: list[int | str], *, window: int = 4096, **kw) -> dict:
    event = {
        "event_id": event_id,
        "window_size": window,
        "data": {"type": "removed", "block_hashes": hashes},
    }
    event.update(kw)
    return event


def created(event_id: int, *, window: int = 4096) -> dict:
    return {
        "event_id": event_id,
        "window_size": window,
        "data": {"type": "created", "num_blocks_per_cache_level": [1024, 0]},
    }


def updated(event_id: int, h: int) -> dict:
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    return {
        "event_id": event_id,
        "window_size": 4096,
        "data": {"type": "updated", "block_hash": h, "cache_level": diff, "priority": diff},
    }


def simple(event_id: int, h: int | None = None, **kw: Any) -> dict:
    """A one-block stored event whose hash identifies it."""
    return stored(event_id, [block(1000 + event_id if h is None else h, [1, 2])], **kw)


# --------------------------------------------------------------------------------------------
# Harness


class Recorder:
    def __init__(self) -> None:
        self.items: list[tuple[Any, ...]] = []
        self.batches: list[EventBatch] = []

    async def on_batch(self, batch: EventBatch, dp_rank: int | None) -> None:
        self.batches.append(batch)
        ids = []
        for ev in batch.events:
            assert isinstance(ev, BlockStored | BlockRemoved)
            ids.append(ev.block_hashes[0])
        self.items.append(("batch", dp_rank, ids))

    def on_resync(self, reason: str) -> None:
        self.items.append(("resync", reason))

    def poller(self, url: str, **kw: Any) -> TrtllmPoller:
        allowed = kw.pop("allowed_publishers", ("127.0.0.1",))
        backoff = kw.pop("backoff", NoBackoff())
        cfg = TrtllmPollerConfig(url=url, allowed_publishers=allowed, poll_interval_ms=1, **kw)
        return TrtllmPoller(cfg, on_batch=self.on_batch, on_resync=self.on_resync, backoff=backoff)


async def eventually(pred: Callable[[], bool]) -> None:
    await waiting.eventually(pred, TIMEOUT, 0.001)


@contextlib.asynccontextmanager
async def running(poller: TrtllmPoller) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(poller.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --------------------------------------------------------------------------------------------
# Tests


async def test_events_are_mapped(serve: FakeTrtllmServe, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events", backend="trt-1")
    serve.push(
        created(0),
        stored(
            1,
            [block(BIG, [11, 12, 13, 14], salt=SALT), block(BIG2, [15, 16])],  # partial last
            parent=None,
        ),
        stored(2, [block(7, [17, 18, 19, 20], level=1)], parent=BIG2),
        stored(3, [block(V2_HASH, [21, 22, 23, 24])], parent=V2_PARENT, hash_algo="v2_sha256"),
        removed(4, [BIG, BIG2]),
        updated(5, BIG),
    )
    # The serializer's exact text for a uint64 above 2**63 (no float detour anywhere).
    serve.push_raw(
        '{"event_id": 6, "window_size": 4096, "data": {"type": "removed",'
        ' "block_hashes": [18446744073709551615]}}'
    )
    async with running(poller):
        await eventually(lambda: poller.stats.received == 7)
        await eventually(lambda: len(rec.items) >= 2)

    assert rec.items[0] == ("resync", "restart")
    assert len(rec.batches) == 1
    batch = rec.batches[0]
    assert batch.dp_rank == 0 and batch.skipped == 0
    first, cpu, v2, gone, gone_big = batch.events
    assert first == BlockStored(
        block_hashes=[BlockHash(BIG), BlockHash(BIG2)],
        parent_block_hash=None,
        token_ids=[11, 12, 13, 14, 15, 16],
        block_size=4,
        medium="GPU",
        cache_salt=SALT,
        block_token_counts=[4, 2],
    )
    assert isinstance(cpu, BlockStored)
    assert (cpu.medium, cpu.parent_block_hash, cpu.cache_salt) == ("CPU", BIG2, None)
    assert isinstance(v2, BlockStored)
    assert v2.block_hashes == [bytes.fromhex(V2_HASH)]
    assert v2.parent_block_hash == bytes.fromhex(V2_PARENT)
    assert gone == BlockRemoved(block_hashes=[BlockHash(BIG), BlockHash(BIG2)])
    assert gone_big == BlockRemoved(block_hashes=[BlockHash(BIG)])
    st = poller.stats
    assert (st.updated_ignored, st.restarts, st.gaps, st.duplicates) == (1, 1, 0, 0)
    assert st.last_event_ids == {0: 6}
    # Never log salts, bodies or token ids.
    text = caplog.text
    assert SALT not in text and "18446744073709551615" not in text and "token_id" not in text


async def test_duplicate_event_ids_are_ignored(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events")
    async with running(poller):
        serve.push(simple(5), simple(6))
        await eventually(lambda: len(rec.items) == 1)
        serve.push(simple(5), simple(6), simple(7))
        await eventually(lambda: len(rec.items) == 2)
    assert rec.items == [("batch", 0, [1005, 1006]), ("batch", 0, [1007])]
    assert poller.stats.duplicates == 2 and poller.stats.resyncs == 0


async def test_event_id_gap_resyncs(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events")
    async with running(poller):
        serve.push(simple(1), simple(2), simple(5), simple(6))
        await eventually(lambda: len(rec.items) == 3)
    assert rec.items == [
        ("batch", 0, [1001, 1002]),
        ("resync", "gap"),
        ("batch", 0, [1005, 1006]),
    ]
    assert poller.stats.gaps == 1 and poller.stats.last_event_ids == {0: 6}


async def test_created_resyncs_once_and_resets_tracking(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events")
    async with running(poller):
        serve.push(simple(40), simple(41))
        await eventually(lambda: len(rec.items) == 1)
        # A restart: one created per window size, then ids continue from there.
        serve.push(
            created(0, window=4096),
            created(1, window=512),
            simple(2),
            simple(3, window=512),  # a sliding-window layer: ignored
            simple(4),
        )
        await eventually(lambda: len(rec.items) == 3)
    assert rec.items == [
        ("batch", 0, [1040, 1041]),
        ("resync", "restart"),
        ("batch", 0, [1002, 1004]),
    ]
    st = poller.stats
    assert (st.restarts, st.resyncs, st.window_filtered, st.gaps, st.duplicates) == (1, 1, 1, 0, 0)


async def test_only_the_largest_window_is_kept(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events")
    async with running(poller):
        serve.push(simple(1, window=512), simple(2, window=4096))
        await eventually(lambda: len(rec.items) == 1)
        # A larger window after smaller-window events were delivered: those were wrong.
        serve.push(simple(3, window=4096), simple(4, window=8192))
        await eventually(lambda: len(rec.items) == 3)
    assert rec.items == [
        ("batch", 0, [1002]),
        ("resync", "window"),
        ("batch", 0, [1004]),
    ]
    assert poller.stats.window_filtered == 2


async def test_ranks_are_tracked_and_batched_separately(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events")
    async with running(poller):
        serve.push(
            simple(10, attention_dp_rank=0),
            simple(11, attention_dp_rank=0),
            simple(0, h=2000, attention_dp_rank=1),
            simple(12, attention_dp_rank=0),
        )
        await eventually(lambda: len(rec.items) == 3)
    assert rec.items == [
        ("batch", 0, [1010, 1011]),
        ("batch", 1, [2000]),
        ("batch", 0, [1012]),
    ]
    assert poller.stats.last_event_ids == {0: 12, 1: 0}


async def test_lower_id_after_a_failed_poll_is_a_restart(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    backoff = NoBackoff()
    poller = rec.poller(f"{serve.base}/kv_cache_events", backoff=backoff)
    async with running(poller):
        serve.push(simple(7))
        await eventually(lambda: len(rec.items) == 1)
        serve.push(simple(3))  # without a failed poll: a duplicate
        await eventually(lambda: poller.stats.duplicates == 1)
        serve.fail_next = 1  # the failed response may have carried (and drained) a created
        serve.push(simple(2))
        await eventually(lambda: len(rec.items) == 3)
    assert rec.items == [("batch", 0, [1007]), ("resync", "restart"), ("batch", 0, [1002])]
    assert poller.stats.poll_errors == 1 and backoff.computed == [1] and backoff.resets == 1


async def test_redirect_is_refused(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    serve.push(simple(1))
    poller = rec.poller(f"{serve.base}/moved")
    async with running(poller):
        await eventually(lambda: poller.stats.poll_errors >= 2)
    assert serve.requests == 0 and serve.queue  # the redirect target was never polled
    assert rec.items == [] and poller.stats.redirects >= 2


async def test_non_array_response_is_counted_and_polling_goes_on(serve: FakeTrtllmServe) -> None:
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/object")
    async with running(poller):
        await eventually(lambda: poller.stats.malformed_responses >= 2)
    # The drain removed what the answer carried: each one is a loss, resynced at once.
    assert poller.stats.poll_errors == 0
    assert rec.items[:2] == [("resync", "decode_error")] * 2
    assert poller.stats.resyncs >= 2


async def test_host_not_allowed_is_refused_before_any_request(serve: FakeTrtllmServe) -> None:
    for allowed in (("10.0.0.0/8",), ()):
        rec = Recorder()
        poller = rec.poller(f"{serve.base}/kv_cache_events", allowed_publishers=allowed)
        with pytest.raises(PublisherNotAllowedError, match=r"127\.0\.0\.1"):
            await asyncio.wait_for(poller.run(), TIMEOUT)
    assert serve.requests == 0
    # A hostname entry that resolves to the URL's address is allowed.
    rec = Recorder()
    poller = rec.poller(f"{serve.base}/kv_cache_events", allowed_publishers=("localhost",))
    async with running(poller):
        serve.push(simple(1))
        await eventually(lambda: len(rec.items) == 1)


def test_map_event_rejects_bad_shapes() -> None:
    good = stored(1, [block(5, [1])])
    assert isinstance(map_event(good), BlockStored)
    bad_events = [
        stored(1, []),  # no blocks
        stored(1, [block(-1.5, [1])]),  # type: ignore[arg-type]  # a float hash
        stored(1, [block("xyz", [1])]),  # not hex
        stored(1, [block(5, [1])], parent="nope"),
        stored(1, [{"block_hash": 5, "tokens": [{"token_id": "1"}]}]),
        removed(1, []),
        removed(1, [True]),
        {"event_id": 1, "data": "stored"},
        {"event_id": 1, "data": {"type": "mystery"}},
    ]
    for event in bad_events:
        assert map_event(event) is None, event
    # A v2 hash is hex even when its length is not 64; layer_group_id maps to group_idx.
    v2 = stored(1, [block("abcd", [1])], hash_algo="v2_sha256", layer_group_id=2)
    mapped = map_event(v2)
    assert isinstance(mapped, BlockStored)
    assert mapped.block_hashes == [b"\xab\xcd"] and mapped.group_idx == 2


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="http"):
        TrtllmPollerConfig(url="ftp://h/kv_cache_events", allowed_publishers=("h",))
    with pytest.raises(ValueError, match="2 s"):
        TrtllmPollerConfig(url="http://h/x", allowed_publishers=("h",), read_timeout_s=2.0)
    with pytest.raises(ValueError, match="not an IP address"):
        TrtllmPollerConfig(url="http://h/x", allowed_publishers=("h h",))
