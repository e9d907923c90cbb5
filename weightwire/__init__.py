"""weightwire: push trainer weights (JAX or PyTorch) into vLLM inference workers.

Layout, following a byte from trainer to worker:

- ``shared``      the wire contract both sides import (numpy only).
- ``jax_side``    pytree -> HF names, ``PytreeSource``, ``JAXTrainerEngine`` (no torch).
- ``torch_side``  ``ModuleSource``, ``TorchTrainerEngine``, worker engines, vLLM plugin,
                  reference server (no jax).
- ``transport``   the communicators that move bytes (TCP, NCCL via cupy); framework-free.
- ``control``     the HTTP / Ray clients that drive a vLLM server's weight-sync routes.
- ``trainer``     the framework-neutral round driver both trainer engines share.
"""

__version__ = "0.1.0"
