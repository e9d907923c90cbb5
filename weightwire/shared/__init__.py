"""The wire contract both sides import. numpy + ml_dtypes only: no jax, no torch.

What the two sides agree on, and only that (helpers such as ``checked_iter`` or the
secret codecs stay in their modules): tensor metadata and the per-round update info,
the init infos' strict parser, the wire dtypes, vLLM's framing (plan / pack / unpack), the
HTTP routes, the server-version gates, the ``Communicator`` protocol a transport
implements, the source protocol, timeouts and limits, and the data-plane errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._lazy import attach

# Lazy, like the other packages: importing one contract module (``shared.errors`` from
# the CLI's extras check, say) must not import numpy through this package.
if TYPE_CHECKING:  # the export list (``weightwire._lazy``)
    from weightwire.shared.communicator import Communicator as Communicator
    from weightwire.shared.dtypes import SUPPORTED_DTYPES as SUPPORTED_DTYPES
    from weightwire.shared.dtypes import WIRE_DTYPES as WIRE_DTYPES
    from weightwire.shared.dtypes import WireDType as WireDType
    from weightwire.shared.dtypes import wire_dtype as wire_dtype
    from weightwire.shared.errors import ConfigError as ConfigError
    from weightwire.shared.errors import ControlTimeout as ControlTimeout
    from weightwire.shared.errors import PeerLost as PeerLost
    from weightwire.shared.errors import ReferenceServerError as ReferenceServerError
    from weightwire.shared.errors import RoundError as RoundError
    from weightwire.shared.errors import SourceMismatch as SourceMismatch
    from weightwire.shared.errors import TransferError as TransferError
    from weightwire.shared.errors import TransferTimeout as TransferTimeout
    from weightwire.shared.errors import UnavailableError as UnavailableError
    from weightwire.shared.errors import WeightSyncError as WeightSyncError
    from weightwire.shared.errors import WeightwireError as WeightwireError
    from weightwire.shared.framing import Chunk as Chunk
    from weightwire.shared.framing import pack_host as pack_host
    from weightwire.shared.framing import plan as plan
    from weightwire.shared.framing import plan_packed as plan_packed
    from weightwire.shared.framing import plan_unpacked as plan_unpacked
    from weightwire.shared.framing import unpack_host as unpack_host
    from weightwire.shared.limits import LIMITS as LIMITS
    from weightwire.shared.limits import Limits as Limits
    from weightwire.shared.meta import ParamMeta as ParamMeta
    from weightwire.shared.routes import ROUTES as ROUTES
    from weightwire.shared.routes import Route as Route
    from weightwire.shared.source import WeightSource as WeightSource
    from weightwire.shared.timeouts import DEFAULT_TIMEOUTS as DEFAULT_TIMEOUTS
    from weightwire.shared.timeouts import Timeouts as Timeouts
    from weightwire.shared.update_info import UpdateInfo as UpdateInfo
    from weightwire.shared.version import VERSION_GATES as VERSION_GATES
    from weightwire.shared.version import ServerFeatures as ServerFeatures
    from weightwire.shared.version import parse_version as parse_version

__getattr__, __dir__ = attach(__name__, globals())
