"""The tools beside the library: nothing a trainer imports lives here.

- ``server``: the reference server (vLLM's weight-sync routes over a Hugging Face model; torch)
- ``models``: the reference Flax models the demo, the benchmarks and the tests train (jax)
- ``demo``, ``bench``, ``cli``: the ``weightwire`` command
"""
