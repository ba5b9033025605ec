"""Command line: ``continuum-router serve --config FILE`` and ``config validate FILE``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .config import ConfigError, load_config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="continuum-router",
        description="KV-cache-aware router for OpenAI- and Anthropic-compatible LLM backends.",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router")
    serve.add_argument("--config", "-c", required=True, type=Path, help="YAML config file")
    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    validate = cfg_sub.add_parser(
        "validate", help="check a config file; exits 1 on any error, prints warnings"
    )
    validate.add_argument("file", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "config":
        try:
            _, issues = load_config(args.file)
        except ConfigError as exc:
            for issue in exc.issues:
                print(issue, file=sys.stderr)
            print(f"{args.file}: invalid ({len(exc.issues)} error(s))", file=sys.stderr)
            return 1
        for issue in issues:
            print(issue, file=sys.stderr)
        print(f"{args.file}: ok ({len(issues)} warning(s))")
        return 0
    try:
        config, issues = load_config(args.config)
    except ConfigError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        return 1
    from .serve import run

    return run(args.config, config, issues)


if __name__ == "__main__":
    sys.exit(main())
