"""``python -m harness.sim``: run one simulated engine.

Prints exactly one line, ``READY <port>``, once the socket is listening (and the KV-event
sockets are bound or connecting), so supervisors (:class:`harness.sim.fleet.SimFleet`, shell
scripts) can wait on it instead of sleeping; with ``--port 0`` that line is the only way to
learn the port.

KV-event example (what a vLLM 0.33 with ``--kv-events-config`` would publish)::

    python -m harness.sim --tokenizer qwen2 --kv-events 'tcp://*:5557' \
        --kv-events-replay 'tcp://*:5558' --kv-events-format vllm-0.33
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from .engine import SimConfig, SimEngine
from .httpserver import bound_port, serve, shutdown
from .kv_wire import FORMATS
from .tokenizer import TOKENIZERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.sim", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001, help="0 picks a free port")
    p.add_argument("--name", default="sim-1", help="reported in x-sim-backend and answers")
    p.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="served model id; repeat for several (default: demo-model)",
    )
    p.add_argument(
        "--block-size", "--kv-block-size", type=int, default=16, help="tokens per KV block/page"
    )
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--prefill-us-per-token", type=float, default=50.0)
    p.add_argument("--prefill-overhead-us", type=float, default=1000.0)
    p.add_argument(
        "--decode-us-per-token", type=float, default=0.0, help="modelled decode (with --latency)"
    )
    p.add_argument("--max-words", type=int, default=64, help="cap on generated words")
    p.add_argument(
        "--latency", action="store_true", help="really sleep the modelled prefill/decode time"
    )
    p.add_argument(
        "--trivial", action="store_true", help="fixed chat answer, no cache (proxy benchmarks)"
    )
    p.add_argument("--unhealthy", action="store_true", help="/health answers 503")
    p.add_argument(
        "--strict-models", action="store_true", help="404 for models not given via --model"
    )
    p.add_argument(
        "--die-with-parent",
        action="store_true",
        help="exit when the parent process goes away (no orphans after a crashed test run)",
    )
    p.add_argument("--no-uvloop", action="store_true", help="use the stdlib event loop")
    p.add_argument("--log-level", default="WARNING")

    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer",
        choices=TOKENIZERS,
        default="simple",
        help="simple: fast crc32 words, lossy /detokenize; qwen2: real BPE + its chat template",
    )
    g.add_argument("--tokenizer-file", help="a tokenizer.json instead of the bundled Qwen2 one")
    g.add_argument(
        "--tokenizer-config",
        help="the tokenizer_config.json with the chat template (default: beside the tokenizer)",
    )
    g.add_argument(
        "--cache-output",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cache the generated tokens' blocks too (default: on with qwen2, off with simple)",
    )
    g.add_argument(
        "--detokenize-format",
        choices=("vllm", "sglang"),
        default="vllm",
        help='/detokenize answers {"prompt": ...} (vllm) or {"text": ...} (sglang)',
    )

    k = p.add_argument_group("KV events (ZMQ, vLLM/SGLang wire formats)")
    k.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="PUB endpoint; binds for tcp://*:P, [::], ipc://, inproc://, else connects",
    )
    k.add_argument("--kv-events-topic", default="", help="topic frame (default empty)")
    k.add_argument("--kv-events-format", choices=tuple(FORMATS), default="vllm-0.33")
    k.add_argument("--kv-events-replay", metavar="ENDPOINT", help="ROUTER replay endpoint")
    k.add_argument("--kv-events-buffer-steps", type=int, default=10_000, metavar="N")
    k.add_argument("--kv-events-hwm", type=int, default=100_000, metavar="N")
    k.add_argument(
        "--kv-events-burst",
        type=int,
        default=0,
        metavar="N",
        help="publish N synthetic batches once the first subscriber connects (benchmarks)",
    )
    k.add_argument("--kv-events-burst-events", type=int, default=8, metavar="N")
    k.add_argument("--dp-rank", type=int, metavar="N", help="adds N to the ports; batch dp_rank")
    k.add_argument(
        "--hash-format",
        choices=("u64", "bytes"),
        default="u64",
        help="vLLM >=0.10.2 block hashes: low 64 bits of the sha256 digest, or its 32 bytes",
    )

    tr = p.add_argument_group("KV events (trtllm-serve HTTP poll)")
    tr.add_argument("--kv-events-trtllm", action="store_true", help="serve POST /kv_cache_events")
    tr.add_argument("--trtllm-poll-block-ms", type=int, default=0, metavar="MS")
    tr.add_argument("--trtllm-window-size", type=int, default=4096)
    tr.add_argument("--trtllm-max-events", type=int, default=10_000, metavar="N")
    p.add_argument(
        "--conversation-chunk-bytes",
        type=int,
        default=1024,
        metavar="N",
        help="bytes per conversation key of GET /sim/held-conversation (the router's chunk_bytes)",
    )
    p.add_argument(
        "--eviction-advisor",
        metavar="HOST:PORT",
        help="evict in the order of a listener's gRPC EvictionAdvisor (SAECache) instead of LRU",
    )
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        name=args.name,
        models=tuple(args.models or ["demo-model"]),
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        prefill_us_per_token=args.prefill_us_per_token,
        prefill_overhead_us=args.prefill_overhead_us,
        decode_us_per_token=args.decode_us_per_token,
        latency=args.latency,
        trivial=args.trivial,
        unhealthy=args.unhealthy,
        strict_models=args.strict_models,
        max_words=args.max_words,
        tokenizer=args.tokenizer,
        tokenizer_file=args.tokenizer_file,
        tokenizer_config=args.tokenizer_config,
        cache_output=args.cache_output,
        detokenize_format=args.detokenize_format,
        kv_events=args.kv_events,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format,
        kv_events_replay=args.kv_events_replay,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_events_hwm=args.kv_events_hwm,
        kv_events_burst=args.kv_events_burst,
        kv_events_burst_events=args.kv_events_burst_events,
        dp_rank=args.dp_rank,
        hash_format=args.hash_format,
        kv_events_trtllm=args.kv_events_trtllm,
        trtllm_poll_block_ms=args.trtllm_poll_block_ms,
        trtllm_window_size=args.trtllm_window_size,
        trtllm_max_events=args.trtllm_max_events,
        eviction_advisor=args.eviction_advisor,
        conversation_chunk_bytes=args.conversation_chunk_bytes,
    )


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            stop.set()


async def run(
    config: SimConfig,
    host: str,
    port: int,
    die_with_parent: bool = False,
    engine: SimEngine | None = None,
) -> None:
    if engine is None:
        engine = SimEngine(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: a supervisor may signal the instant it reads READY.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await engine.start()
    try:
        server = await serve(engine, host, port)
        sys.stdout.write(f"READY {bound_port(server)}\n")
        sys.stdout.flush()
        watcher = asyncio.create_task(_watch_parent(stop)) if die_with_parent else None
        try:
            await stop.wait()
        finally:
            if watcher is not None:
                watcher.cancel()
            await shutdown(server)
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        # Built before binding, so bad flags fail fast with a message (and a real tokenizer
        # is loaded once).
        engine = SimEngine(config)
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if not args.no_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            logging.getLogger("harness.sim").warning("uvloop missing; using asyncio loop")
    try:
        with (
            contextlib.suppress(KeyboardInterrupt),
            asyncio.Runner(loop_factory=loop_factory) as runner,
        ):
            runner.run(run(config, args.host, args.port, args.die_with_parent, engine))
    except OSError as e:  # typically: address already in use
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # zmq.ZMQError: a KV-event endpoint cannot be bound/connected
        if type(e).__module__.startswith("zmq"):
            print(f"error: KV events: {e}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
