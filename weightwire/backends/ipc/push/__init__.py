"""``weightwire_ipc`` push: the trainer's slots, copied out piece by piece (``worker``: the
worker's link; rank 0's data path is ``ipc.pipeline``)."""
