"""``weightwire demo`` and ``weightwire doctor``: the command line's working parts.

- ``loop``     the RL loop (rollouts -> reward -> JAX policy step -> send_weights -> checks).
- ``policy``   the Flax policy and its REINFORCE + Adam step.
- ``reward``   the visible reward (fraction of tokens containing a target character).
- ``rollout``  ``/v1/completions`` in token ids, with the server's logprobs.
- ``server``   the child processes: tiny-model build and the embedded reference server.
- ``render``   rich output; ``doctor`` the server check.

Importing this package loads neither jax nor torch.
"""
