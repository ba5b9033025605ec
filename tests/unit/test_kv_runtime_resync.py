"""A Redis KV index that comes back from an outage makes the runtime start every event
stream over from a snapshot: a Redis restarted empty lost every entry written before the
outage, and a resumed stream would bring back only what followed the router's position
(the fault matrix's ``redis-kill`` row found the entries lost for good)."""

from __future__ import annotations

from listener.sse_server import SseServer
from listener.stream import EventHub
from router.config import parse_config
from router.kv_runtime import KvRuntime
from router.kvindex import FallbackKvIndex
from router.redis import RedisPools
from tests import waiting


async def test_redis_recovery_resyncs_every_stream_once() -> None:
    hub = EventHub(backends=["a"], epoch="e1")
    server = SseServer(hub, heartbeat_interval=30.0)
    port = await server.start("127.0.0.1", 0)
    pools = RedisPools()
    cfg, _ = parse_config(
        {
            "prefix_routing": {"enabled": True},
            "response_cache": {"redis": {"url": "redis://127.0.0.1:1"}},
            "backends": [{"name": "a", "url": "http://h:1", "type": "vllm", "models": ["m"]}],
            "kv_cache_index": {
                "enabled": True,
                "backend": "redis",
                "conversation": {"enabled": True},
                "event_sources": [
                    {
                        "backend_name": "a",
                        "endpoint": f"http://127.0.0.1:{port}/events/a",
                        "reconnect_interval_ms": 100,
                    }
                ],
            },
        }
    )
    kv = KvRuntime(cfg, pools=pools)
    try:
        prefix, chain = kv.index.inner, kv.chain_index.inner if kv.chain_index else None
        assert isinstance(prefix, FallbackKvIndex) and isinstance(chain, FallbackKvIndex)
        assert prefix.on_recovered is not None and chain.on_recovered is not None
        await kv.start()

        def blocks() -> int:
            return int(hub.stats()["backends"]["a"]["resync_blocks"])

        await waiting.eventually(lambda: blocks() == 1, 5, 0.01, "the first resync")
        # Both indexes come back in the same tick: one resync, not two.
        prefix.on_recovered()
        chain.on_recovered()
        assert kv.index_resyncs == 1
        await waiting.eventually(lambda: blocks() == 2, 5, 0.01, "a resync from a snapshot")
        assert kv.consumer_stats()["a"]["connected"]
    finally:
        await kv.stop()
        await server.stop()
        await pools.aclose()
