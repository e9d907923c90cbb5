"""``python -m weightwire ...``: the same command line as ``weightwire ...``."""

import sys

from weightwire.tools.cli import main

sys.exit(main())
