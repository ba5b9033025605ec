"""``python -m bench.sim``: run one simulated engine.

Prints exactly one line, ``READY <port>``, once the socket is listening, so supervisors
(:class:`bench.sim.fleet.SimFleet`, shell scripts) can wait on it instead of sleeping; with
``--port 0`` that line is the only way to learn the port.
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__)
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
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--prefill-us-per-token", type=float, default=50.0)
    p.add_argument("--prefill-overhead-us", type=float, default=1000.0)
    p.add_argument("--max-words", type=int, default=64, help="cap on generated words")
    p.add_argument("--latency", action="store_true", help="really sleep the modelled prefill time")
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
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        name=args.name,
        models=tuple(args.models or ["demo-model"]),
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        prefill_us_per_token=args.prefill_us_per_token,
        prefill_overhead_us=args.prefill_overhead_us,
        latency=args.latency,
        trivial=args.trivial,
        unhealthy=args.unhealthy,
        strict_models=args.strict_models,
        max_words=args.max_words,
    )


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(0.5)
        if os.getppid() != parent:
            stop.set()


async def run(config: SimConfig, host: str, port: int, die_with_parent: bool = False) -> None:
    engine = SimEngine(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: a supervisor may signal the instant it reads READY.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
        SimEngine(config)  # validate before binding, so bad flags fail fast with a message
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if not args.no_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            logging.getLogger("bench.sim").warning("uvloop missing; using asyncio loop")
    try:
        with (
            contextlib.suppress(KeyboardInterrupt),
            asyncio.Runner(loop_factory=loop_factory) as runner,
        ):
            runner.run(run(config, args.host, args.port, args.die_with_parent))
    except OSError as e:  # typically: address already in use
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
