"""Static half of ``test_client_protocol``: mypy (``[tool.mypy] files``, run by CI) checks
that our clients, communicators and the test doubles satisfy the protocols the engine
is typed with. Structural: none of them inherits from a protocol, so without this an
edit to a signature (a renamed or now-required parameter) would only fail at run time.
Nothing here runs (not a test module: pytest does not collect it).
"""

from __future__ import annotations

from tests.trainer.fakes import FakeComm
from weightwire.backends.base import Link
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.control.fallback import FallbackClient
from weightwire.control.ray_client import RayWeightSyncClient
from weightwire.shared.client import EngineClient, ServerControls, WeightSyncClient
from weightwire.shared.communicator import Communicator, DeviceCommunicator
from weightwire.testing.loopback import LoopbackClient


def clients(
    http: HTTPWeightSyncClient,
    ray: RayWeightSyncClient,
    fallback: FallbackClient,
    loopback: LoopbackClient,
) -> list[WeightSyncClient]:
    return [http, ray, fallback, loopback]


def controls(http: HTTPWeightSyncClient, fallback: FallbackClient) -> list[ServerControls]:
    # Ray and loopback clients have only some of the optional calls: the engine checks
    # those by name at trainer_init (test_client_protocol covers which).
    return [http, fallback]


def engine_client(http: HTTPWeightSyncClient) -> EngineClient:
    return http


def communicators(
    tcp: TCPCommunicator, nccl: NCCLCommunicator, fake: FakeComm
) -> list[Communicator]:
    return [tcp, nccl, fake]


def links(
    tcp: TCPCommunicator, nccl: NCCLCommunicator, ipc: IPCSenderComm, fake: FakeComm
) -> list[Link]:
    return [tcp, nccl, ipc, fake]


def device_communicator(nccl: NCCLCommunicator) -> DeviceCommunicator:
    return nccl
