"""``python -m benchmarks.soak`` (from the repository root): see the package's docstring or ``--help``."""

import sys

from .cli import main

sys.exit(main())
