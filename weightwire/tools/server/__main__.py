"""``python -m weightwire.tools.server --model tiny-llama --port 0``."""

import sys

from weightwire._lifetime import stop_on_signals
from weightwire.tools.server import serve_main

# SIGTERM / SIGHUP while starting unwind like Ctrl-C (uvicorn takes over once serving).
stop_on_signals()
sys.exit(serve_main(sys.argv[1:]))
