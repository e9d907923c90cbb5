"""The wire contract both sides import. numpy + ml_dtypes only: no jax, no torch."""

from weightwire.shared.communicator import Communicator
from weightwire.shared.dtypes import SUPPORTED_DTYPES, WIRE_DTYPES, WireDType, wire_dtype, wire_name_of_numpy
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
from weightwire.shared.groups import layer_key, layerwise_groups
from weightwire.shared.info import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    INIT_INFO_TYPES,
    NCCLInitInfo,
    TCPInitInfo,
    UpdateInfo,
    WeightwireNCCLInitInfo,
    encode_secret,
)
from weightwire.shared.limits import LIMITS, Limits
from weightwire.shared.meta import ParamMeta
from weightwire.shared.routes import ROUTES, Route
from weightwire.shared.source import WeightSource, checked_iter
from weightwire.shared.timeouts import DEFAULT_TIMEOUTS, Timeouts
from weightwire.shared.version import VERSION_GATES, ServerFeatures, parse_version

__all__ = [
    "ConfigError", "ControlTimeout", "ReferenceServerError", "RoundError", "UnavailableError",
    "WeightSyncError", "WeightwireError",
    "Chunk", "Communicator", "DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_TIMEOUTS", "INIT_INFO_TYPES", "LIMITS", "Limits", "NCCLInitInfo", "ParamMeta",
    "PeerLost", "ROUTES", "Route", "SUPPORTED_DTYPES", "ServerFeatures", "SourceMismatch",
    "TCPInitInfo", "Timeouts", "TransferError", "TransferTimeout", "UpdateInfo", "VERSION_GATES",
    "WIRE_DTYPES", "WeightSource", "WeightwireNCCLInitInfo", "WireDType", "checked_iter",
    "encode_secret", "layer_key", "layerwise_groups", "pack_host", "parse_version", "plan",
    "plan_packed", "plan_unpacked", "unpack_host", "wire_dtype", "wire_name_of_numpy",
]
