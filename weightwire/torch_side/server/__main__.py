"""``python -m weightwire.torch_side.server --model tiny-llama --port 0``."""

import sys

from weightwire.torch_side.server import serve_main

sys.exit(serve_main(sys.argv[1:]))
