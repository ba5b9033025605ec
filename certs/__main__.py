"""``python -m certs``: the development PKI on the command line (see ``certs.cli``)."""

import sys

from .cli import main

sys.exit(main())
