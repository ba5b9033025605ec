"""Command line of ``continuum-kv-listener``: ``--config FILE`` runs, ``--check`` validates.

The process itself lives in ``listener.app.run(config)``, imported only when the
listener is about to run, so ``--help`` and ``--check`` work without it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from bus.collector import tune_collector

from .config import ConfigError, ListenerConfig, load_listener_config, log_warnings

__all__ = ["main"]

PROG = "continuum-kv-listener"

_DESCRIPTION = f"""\
NAME
    {PROG} - turn LLM engines' KV cache events into per-backend prefix events

SYNOPSIS
    {PROG} --config FILE [--log-level LEVEL]
    {PROG} --config FILE --check

DESCRIPTION
    Listens to the KV cache events of inference engines (vLLM and SGLang over ZMQ
    msgpack, trtllm-serve over HTTP JSON polling), tracks each backend's block chains
    within fixed memory bounds, recovers the prefix key of each chain (through the
    engine's /detokenize and chat template, or a router-issued cache salt), and serves
    the resulting prefix events per backend:

      GET /events/{{backend}}   text/event-stream; resumes after Last-Event-ID
      GET /health, /stats      JSON
      GET /metrics             Prometheus text
      gRPC continuum.listener.v1.Listener on grpc_listen (plus health, reflection)

    Each record is {{"event","backend","prefix_hash","token_count","tier"}} with the SSE
    id <epoch>-<seq>: the epoch is fixed per process start, seq rises by 1 per event
    per backend. A consumer resuming with an id still in the backend's history ring
    gets exactly the missed records; any other consumer (no id, another epoch, too
    old) first gets a `resync` record and a snapshot of `cache_created` records. A
    consumer that falls subscriber_queue_size events behind is closed with an
    explicit `buffer_overflow` error record, never silently dropped.
"""

_EPILOG = f"""\
CONFIGURATION
    A YAML file; see config.kv-listener.yaml.example for every option. Top level:
      listen                 SSE/HTTP host:port (default 127.0.0.1:7817)
      grpc_listen, grpc_tls  gRPC host:port (unset = off); TLS cert/key[/client_ca]
      history_size           events kept per backend for resumption (10000)
      heartbeat_interval_ms  idle SSE comment interval (15000)
      subscriber_queue_size  live events queued per subscriber (4096)
      salt_secret_file|_env  HMAC secret shared with the router for cache salts
      checkpoint_dir         per-source checkpoint files (unset = off);
                             checkpoint_interval_ms (1000), checkpoint_max_age_s (3600)
      sources[]              backend_name, engine (vllm|sglang|trtllm), zmq_endpoint,
                             zmq_mode, topic, replay_endpoint, dp_ranks,
                             trtllm_endpoint, poll_interval_ms, detokenize_endpoint,
                             model, chat_template, default_system_prompt,
                             allowed_publishers, max_chain_tokens,
                             max_tracked_blocks, max_retained_tokens
      event_bus              push mode: url (https) or urls (several routers),
                             ca_file, tls_server_name,
                             client_id, credential_file|credential_env,
                             client_cert_file + client_key_file (mTLS),
                             reconnect_backoff, drain_deadline, connect_timeout,
                             batch_max_bytes, batch_linger_ms
    Every error names its YAML path (e.g. sources[1].zmq_endpoint).

PUSH MODE
    With event_bus set, the listener also dials the router's gRPC EventBus over TLS,
    announces its sources (Hello) and serves every Subscribe with the same bytes as
    GET /events/{{backend}} for that Last-Event-ID; it reconnects with backoff.
    With event_bus.urls it keeps one such session per router (replicas sharing one
    Redis index): each reconnects, resumes and drains on its own.

SIGNALS
    SIGTERM, SIGINT
        In push mode first send Draining and close the bus streams within
        drain_deadline (the router moves the sources to another listener). Stop the
        sources, write each source's checkpoint (with checkpoint_dir), end every
        SSE and gRPC stream (consumers resume from their last event id elsewhere or
        after restart) and exit with status 0.
    SIGHUP
        Not used in this version: the configuration is read once at start.

EXIT STATUS
    0   normal exit, or --check found no error (warnings are printed)
    1   the configuration is invalid, or the listener could not start (an address
        in use, a file that cannot be read)
    2   wrong command line usage

EXAMPLES
    Check a configuration, then run it:
        {PROG} --config /etc/continuum/config.kv-listener.yaml --check
        {PROG} --config /etc/continuum/config.kv-listener.yaml

    Follow one backend's events from the start (resync and snapshot first):
        curl -N http://127.0.0.1:7817/events/vllm-1

    Resume after an id:
        curl -N -H 'Last-Event-ID: 3f9a1c0e-1234' http://127.0.0.1:7817/events/vllm-1

    Ask the gRPC service:
        grpcurl -plaintext 127.0.0.1:7818 continuum.listener.v1.Listener/Stats

SEE ALSO
    continuum-router(1), docs/ARCHITECTURE.md, listener/ENGINE_FORMATS.md.
"""


def _version() -> str:
    try:
        return metadata.version("continuum")
    except metadata.PackageNotFoundError:
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --config FILE [--check] [--log-level LEVEL]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    opts = p.add_argument_group("OPTIONS")
    opts.add_argument(
        "-c",
        "--config",
        required=True,
        type=Path,
        metavar="FILE",
        help="the YAML configuration file (required)",
    )
    opts.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration, print its errors and warnings, and exit: "
        "0 when it is usable, 1 when not",
    )
    opts.add_argument(
        "--log-level",
        default="INFO",
        metavar="LEVEL",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="DEBUG, INFO (default), WARNING or ERROR",
    )
    opts.add_argument("-V", "--version", action="version", version=f"{PROG} {_version()}")
    opts.add_argument("-h", "--help", action="help", help="show this help and exit")
    return p


def _run(config: ListenerConfig) -> int:
    try:
        from .app import run
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.app":
            raise
        print(f"{PROG}: this build has no listener.app; only --check works", file=sys.stderr)
        return 1
    tune_collector()  # the ingestion path allocates containers by the dozen per event
    try:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency; keep a fallback
            result = asyncio.run(run(config))
        else:
            result = uvloop.run(run(config))
    except KeyboardInterrupt:
        return 0
    except OSError as exc:
        logging.getLogger("continuum.listener").error("cannot start: %s", exc)
        return 1
    finally:
        sys.stdout.flush()
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``continuum-kv-listener`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config, warnings = load_listener_config(args.config)
    except ConfigError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        print(f"{args.config}: invalid ({len(exc.issues)} error(s))", file=sys.stderr)
        return 1
    if args.check:
        for issue in warnings:
            print(issue, file=sys.stderr)
        print(f"{args.config}: ok ({len(warnings)} warning(s))")
        return 0
    log_warnings(warnings)
    return _run(config)


if __name__ == "__main__":
    sys.exit(main())
