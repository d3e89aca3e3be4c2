"""``python -m smddp.server`` runs the daemon."""

import sys

from smddp.server.main import main

sys.exit(main())
