"""``weightwire_ipc`` write-through: the trainer writes each tensor straight into the worker's
serving parameters (``table``: the landing table message; ``pipeline``: rank 0's data path;
``kernels``: strided / casting copies; ``worker``: the worker's link)."""
