"""``weightwire bench``: the benchmarks, shipped in the package so an installed wheel runs them.

- ``comm``       data plane only: ``TCPCommunicator`` vs a raw socket loop (CPU), and
                 ``comm_nccl``: ``NCCLCommunicator`` vs raw CuPy NCCL (two GPUs).
- ``sync``       whole weight-sync rounds on two GPUs (``sync_http``, ``sync_shim``: the
                 control planes; ``sync_trace``: where one round's time goes).

Each module runs as ``python -m weightwire.tools.bench.<name>``; children it spawns run the
same way (``child.spawn_child``: with the parent's weightwire first on the import path).
"""
