"""The fault matrix: real processes, one fault per row, each row its own oracle.

``make faults`` runs every row (``python -m tests.faults [ROW ...]``), prints one table and
writes it to ``tests/faults/RESULTS.md`` with the command that made it. The oracle is the
engines' own account of what they hold (``GET /sim/held-prefixes``), never the listener's:
after the fault heals, each row compares the router's KV index with it. ``procedure.py`` says
how each figure is measured; ``record.py`` holds the comparison and the table.
"""
