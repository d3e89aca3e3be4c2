"""tests/frameworks: frameworks and launchers on backend "smddp" with real daemons and ranks."""

from __future__ import annotations

import sys
from pathlib import Path

# run_world (tests/backend/smddp_world.py) starts the ranks of a world.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backend"))

# The torch suite runs as its own CI step (scripts/test.sh), not in the default run.
collect_ignore = ["torch_suite.py"]
