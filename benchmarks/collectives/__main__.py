"""Entry point for ``python -m benchmarks.collectives``."""

import sys

from benchmarks.collectives.cli import main

if __name__ == "__main__":
    sys.exit(main())
