"""``python -m weightwire ...``: the same command line as ``weightwire ...``."""

import sys

from weightwire.cli import main

sys.exit(main())
