"""Small Flax reference models whose parameters map onto HF checkpoints by the presets.

``llama`` (also Mistral), ``qwen2``, ``qwen3``, ``gemma`` share ``decoder``; ``gpt2``
is separate. Each family module offers ``init(rng, cfg)``, ``apply(params, tokens, cfg)``
and ``naming(cfg)``. For tests, demos and benchmarks, not for speed.
"""

from weightwire._extras import require

require("flax", purpose="weightwire.tools.models")
