"""Backend name -> the init info class its workers parse ``init_info`` with.

Its own module so that ``info`` (the base parsers) and ``ipc_info`` (which builds on
them) need not import each other: the table is the one place that sees every init
info, and nothing in ``shared`` imports it back.
"""

from __future__ import annotations

from weightwire.shared.info import NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo
from weightwire.shared.ipc_info import IPCInitInfo

InitInfo = NCCLInitInfo | TCPInitInfo | IPCInitInfo
"""Any worker init info (``WeightwireNCCLInitInfo`` is an ``NCCLInitInfo``)."""

INIT_INFO_TYPES: dict[str, type[InitInfo]] = {
    cls.backend: cls for cls in (NCCLInitInfo, WeightwireNCCLInitInfo, TCPInitInfo, IPCInitInfo)
}
