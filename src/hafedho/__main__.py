"""``python -m hafedho``: the same command-line interface as ``hafedho``."""

import sys

from hafedho.console import main

sys.exit(main())
