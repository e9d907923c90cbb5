"""The toy backend's standalone worker engine (what ``weightwire.testing.loopback.serve`` runs)."""

from __future__ import annotations

from tests.backends.toy_backend.info import ToyFilesInitInfo
from tests.backends.toy_backend.spec import TOY_FILES
from weightwire.torch_side.worker.engines import StandaloneEngine


class ToyFilesEngine(StandaloneEngine):
    """``toy_files`` receiver: CPU or GPU worker, chunks read from files."""

    backend = TOY_FILES.name
    init_info_cls = ToyFilesInitInfo  # type: ignore[assignment]  # the attribute is typed as the built-ins' union
