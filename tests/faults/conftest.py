"""The fault matrix is not part of ``make test``: it runs as ``make faults`` (``python -m
tests.faults``), minutes of real processes under traffic, and prints a table instead of
passing or failing. Nothing in this directory is collected by pytest."""

collect_ignore_glob = ["*.py"]
