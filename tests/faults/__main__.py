"""``python -m tests.faults [ROW ...] [--slow] [--out PATH]``: run the fault matrix (the
rows not marked slow, unless ``--slow``), print its table and write it, with the command
that made it, to ``tests/faults/RESULTS.md`` (``--out -``: print only).
Rows run one after another, each on its own fresh stack."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from .procedure import options_doc, run_rows
from .record import render_table
from .rows import ROWS

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    p.add_argument("rows", nargs="*", help=f"rows to run (default: all): {', '.join(ROWS)}")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="'-': do not write")
    p.add_argument("--slow", action="store_true", help="also the rows marked slow (minutes each)")
    args = p.parse_args(argv)
    names = args.rows or [n for n, r in ROWS.items() if args.slow or not r.slow]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows: {', '.join(unknown)}")
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    results = asyncio.run(run_rows([ROWS[n] for n in names]))
    table = render_table(results)
    elapsed = time.monotonic() - t0
    sys.stdout.write(table)
    if args.out != "-":
        command = os.environ.get("FAULTS_COMMAND") or "python -m tests.faults " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
        )
        doc = [
            "# Fault matrix: latest results",
            "",
            f"Made by `{command.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f" ({platform.python_implementation()} {platform.python_version()}, "
            f"{os.cpu_count()} cores, {elapsed:.0f} s). How each figure is measured: "
            "`tests/faults/procedure.py`. Phases (seconds): " + json.dumps(options_doc()) + ".",
            "",
            table,
        ]
        Path(args.out).write_text("\n".join(doc), encoding="utf-8")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
