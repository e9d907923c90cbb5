"""Control plane: clients that drive a vLLM server's weight-sync routes.

``HTTPWeightSyncClient`` (httpx) for servers, ``RayWeightSyncClient`` for engine
actors (``ray`` imported lazily). Both raise ``WeightSyncError`` on any failure.
"""

from weightwire.control.client import HTTPWeightSyncClient, NotAdvertised
from weightwire.control.ray_client import RayWeightSyncClient
from weightwire.control.ready import ServerNotReady, wait_until_ready
from weightwire.shared.errors import WeightSyncError

__all__ = [
    "HTTPWeightSyncClient",
    "NotAdvertised",
    "RayWeightSyncClient",
    "ServerNotReady",
    "WeightSyncError",
    "wait_until_ready",
]
