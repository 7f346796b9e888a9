"""``python -m backend.server``: the backend alone (see ``backend.server.main``)."""

import sys

from backend.server.main import main

sys.exit(main())
