"""The keys of vLLM's NCCL worker init info, as the tests that check payloads and parsers
spell them once."""

UNIQUE_ID_KEYS = (
    "nccl_unique_id_b64",
    "rank_offset",
    "world_size",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
)
"""A unique-id rendezvous (vLLM >= 0.30, what a torch-free trainer sends): no TCPStore address."""

NCCL_KEYS = ("master_address", "master_port", *UNIQUE_ID_KEYS)
"""Every key vLLM's ``nccl`` info parses (a TCPStore rendezvous or a unique id)."""
