"""``python -m listener``: the same as the ``continuum-kv-listener`` console script."""

import sys

from .cli import main

sys.exit(main())
