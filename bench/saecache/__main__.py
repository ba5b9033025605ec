"""``python -m bench.saecache``: trace-driven evaluation of SAECache (see ``eval``)."""

from .eval import main

if __name__ == "__main__":
    raise SystemExit(main())
