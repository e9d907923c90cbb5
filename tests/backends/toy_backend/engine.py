"""The toy backend's standalone worker engine (what ``weightwire.testing.loopback.serve`` runs):
its name and init info come from the spec naming it, as for the built-in engines."""

from __future__ import annotations

from weightwire.torch_side.worker.engines import StandaloneEngine


class ToyFilesEngine(StandaloneEngine):
    """``toy_files`` receiver: CPU or GPU worker, chunks read from files."""
