"""The wire contract both sides import. numpy + ml_dtypes only: no jax, no torch.

What the two sides agree on, and only that (helpers such as ``checked_iter`` or the
secret codecs stay in their modules): tensor metadata and the per-round update info,
the worker init infos, the wire dtypes, vLLM's framing (plan / pack / unpack), the
HTTP routes, the server-version gates, the ``Communicator`` protocol a transport
implements, the source protocol, timeouts and limits, and the data-plane errors.
"""

from weightwire.shared.communicator import Communicator
from weightwire.shared.dtypes import SUPPORTED_DTYPES, WIRE_DTYPES, WireDType, wire_dtype
from weightwire.shared.errors import (
    ConfigError,
    ControlTimeout,
    PeerLost,
    ReferenceServerError,
    RoundError,
    SourceMismatch,
    TransferError,
    TransferTimeout,
    UnavailableError,
    WeightSyncError,
    WeightwireError,
)
from weightwire.shared.framing import Chunk, pack_host, plan, plan_packed, plan_unpacked, unpack_host
from weightwire.shared.info import NCCLInitInfo, TCPInitInfo, UpdateInfo, WeightwireNCCLInitInfo
from weightwire.shared.ipc_info import IPCInitInfo
from weightwire.shared.limits import LIMITS, Limits
from weightwire.shared.meta import ParamMeta
from weightwire.shared.routes import ROUTES, Route
from weightwire.shared.source import WeightSource
from weightwire.shared.timeouts import DEFAULT_TIMEOUTS, Timeouts
from weightwire.shared.version import VERSION_GATES, ServerFeatures, parse_version

__all__ = [
    "ConfigError", "ControlTimeout", "ReferenceServerError", "RoundError", "UnavailableError",
    "WeightSyncError", "WeightwireError",
    "Chunk", "Communicator", "DEFAULT_TIMEOUTS", "IPCInitInfo", "LIMITS", "Limits", "NCCLInitInfo", "ParamMeta",
    "PeerLost", "ROUTES", "Route", "SUPPORTED_DTYPES", "ServerFeatures", "SourceMismatch", "TCPInitInfo",
    "Timeouts", "TransferError", "TransferTimeout", "UpdateInfo", "VERSION_GATES", "WIRE_DTYPES", "WeightSource",
    "WeightwireNCCLInitInfo", "WireDType", "pack_host", "parse_version", "plan", "plan_packed", "plan_unpacked",
    "unpack_host", "wire_dtype",
]
