"""A data-moving stand-in for NVIDIA's ``nccl.core`` (NCCL4Py) and ``nccl.m2n``, on the CPU.

Ranks are threads of one process. A collective is matched by its position in each rank's
sequence of calls on one communicator world (as NCCL does); once every rank of the world
arrived, it runs: a ``broadcast`` copies the root's buffer into every rank's, a ``reshard``
rebuilds the whole tensor from the source ranks' local parts (each a row-major mesh
position's even split, as ``nccl.m2n`` lays them out) and writes each destination rank's
part into its buffer. Every rank must pass the same meshes and placements (else every rank
of that call raises, where real NCCL would corrupt or hang). Buffers are numpy arrays or CPU
torch tensors (written through ``.numpy()``, so a worker's parameter is written in place).
Group calls (``group_start`` / ``group_end``, ``m2n.group()``) arrive at once and are only
enqueued at the group's end (a ``FakeXP`` stream is done once they completed), so one thread
can drive several ranks. Every wait is bounded (``TIMEOUT_S``).

``modules()`` / ``install()`` give ``nccl``, ``nccl.core`` and ``nccl.m2n`` as these fakes;
``FakeXP`` is the CuPy surface ``m2n_data.NcclM2NDataPlane`` uses.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

TIMEOUT_S = 30.0
_local = threading.local()


def as_numpy(buf: Any) -> np.ndarray:
    if hasattr(buf, "detach"):  # a CPU torch tensor: a view of its storage
        return buf.detach().numpy()
    return np.asarray(buf)


class _Op:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parts: dict[int, Any] = {}
        self.done = False
        self.error: str | None = None


class World:
    """The ranks of one unique id."""

    worlds: dict[bytes, World] = {}
    lock = threading.Lock()

    def __init__(self, nranks: int) -> None:
        self.nranks = nranks
        self.cond = threading.Condition()
        self.seq = dict.fromkeys(range(nranks), 0)
        self.ops: dict[int, _Op] = {}
        self.aborted = False
        self.received = dict.fromkeys(range(nranks), 0)
        """Bytes each rank's reshard destination buffers were written."""
        self.reshards = 0

    @classmethod
    def of(cls, uid: bytes, nranks: int) -> World:
        with cls.lock:
            world = cls.worlds.setdefault(uid, World(nranks))
        if world.nranks != nranks:
            raise RuntimeError(f"fake NCCL: nranks {nranks} != the world's {world.nranks}")
        return world

    def arrive(self, rank: int, kind: str, payload: Any) -> _Op:
        with self.cond:
            n = self.seq[rank]
            self.seq[rank] = n + 1
            op = self.ops.setdefault(n, _Op(kind))
            if op.kind != kind:
                op.error = f"rank {rank} called {kind} where another rank called {op.kind}"
            op.parts[rank] = payload
            if len(op.parts) == self.nranks:
                if op.error is None:
                    try:
                        getattr(self, f"_run_{kind}")(op.parts)
                    except Exception as exc:
                        op.error = f"{type(exc).__name__}: {exc}"
                op.done = True
                self.cond.notify_all()
            return op

    def wait(self, op: _Op) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: op.done or self.aborted, TIMEOUT_S):
                raise RuntimeError(f"fake NCCL: {op.kind} never completed (a rank never came)")
        if self.aborted and not op.done:
            raise RuntimeError("fake NCCL: communicator aborted")
        if op.error:
            raise RuntimeError(f"fake NCCL: {op.kind} failed: {op.error}")

    def _run_broadcast(self, parts: dict[int, Any]) -> None:
        roots = {p[2] for p in parts.values()}
        if len(roots) != 1:
            raise ValueError(f"ranks disagree on the root: {sorted(roots)}")
        (root,) = roots
        src = as_numpy(parts[root][0])
        for _send, recv, _root in parts.values():
            out = as_numpy(recv)
            if out.shape != src.shape or out.dtype != src.dtype:
                raise ValueError(f"broadcast of {src.dtype}{src.shape} into {out.dtype}{out.shape}")
            out[...] = src

    def _run_reshard(self, parts: dict[int, Any]) -> None:
        layouts = {p[2:] for p in parts.values()}
        if len(layouts) != 1:
            raise ValueError(
                f"ranks disagree on the meshes / placements: {sorted(map(str, layouts))}"
            )
        (src_mesh, src_pl, dst_mesh, dst_pl) = next(iter(layouts))
        src_ranks = range(src_mesh.start_rank, src_mesh.start_rank + src_mesh.size)
        dst_ranks = range(dst_mesh.start_rank, dst_mesh.start_rank + dst_mesh.size)
        first = as_numpy(parts[src_ranks[0]][0])
        shape = list(first.shape)
        for axis, code in enumerate(src_pl):
            if code >= 0:
                shape[code] *= src_mesh.dims[axis]
        whole = np.zeros(shape, dtype=first.dtype)
        for r in src_ranks:
            whole[_box(src_mesh, src_pl, shape, r)] = as_numpy(parts[r][0])
        for r in dst_ranks:
            out = as_numpy(parts[r][1])
            part = whole[_box(dst_mesh, dst_pl, shape, r)]
            if out.shape != part.shape or out.dtype != part.dtype:
                raise ValueError(
                    f"rank {r}'s buffer is {out.dtype}{out.shape}, "
                    f"its part {part.dtype}{part.shape}"
                )
            out[...] = part
            self.received[r] += part.nbytes
        self.reshards += 1


def _box(mesh: Mesh, placements: tuple[int, ...], shape: list[int], rank: int) -> tuple[slice, ...]:
    i = rank - mesh.start_rank
    coord = (i // mesh.dims[1], i % mesh.dims[1])
    out = [slice(0, n) for n in shape]
    for axis, code in enumerate(placements):
        if code >= 0:
            part = shape[code] // mesh.dims[axis]
            out[code] = slice(coord[axis] * part, (coord[axis] + 1) * part)
    return tuple(out)


# -- nccl.core --------------------------------------------------------------------------------


class UniqueId:
    def __init__(self, raw: bytes) -> None:
        self.as_bytes = raw

    @staticmethod
    def from_bytes(raw: bytes) -> UniqueId:
        if len(raw) != 128:
            raise ValueError("a unique id is 128 bytes")
        return UniqueId(bytes(raw))


def get_unique_id() -> UniqueId:
    return UniqueId(os.urandom(128))


def _pending() -> list[tuple[World, _Op]] | None:
    return getattr(_local, "pending", None)


def _submit(world: World, op: _Op) -> None:
    pending = _pending()
    if pending is None:
        world.wait(op)
    else:
        pending.append((world, op))


def group_start() -> None:
    _local.pending = []


OUTSTANDING: list[tuple[World, _Op]] = []
"""What groups submitted: as with real NCCL a group's end only enqueues, and a stream is
done (``FakeXP``'s streams) once every op enqueued before is."""


def group_end() -> None:
    pending, _local.pending = _pending() or [], None
    OUTSTANDING.extend(pending)


def drained() -> bool:
    for _world, op in OUTSTANDING:
        if op.error:
            raise RuntimeError(f"fake NCCL: {op.kind} failed: {op.error}")
    OUTSTANDING[:] = [(w, op) for w, op in OUTSTANDING if not (op.done or w.aborted)]
    return not OUTSTANDING


def reset() -> None:
    """Forget every world and enqueued op (between tests)."""
    World.worlds.clear()
    OUTSTANDING.clear()


class Communicator:
    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId, config: Any = None) -> Communicator:
        return cls(World.of(unique_id.as_bytes, nranks), rank)

    def broadcast(self, sendbuf: Any, recvbuf: Any, root: int, *, stream: Any = None) -> None:
        _submit(self.world, self.world.arrive(self.rank, "broadcast", (sendbuf, recvbuf, root)))

    def abort(self) -> None:
        with self.world.cond:
            self.world.aborted = True
            self.world.cond.notify_all()

    def destroy(self) -> None:
        pass


# -- nccl.m2n ---------------------------------------------------------------------------------


class Mesh:
    def __init__(self, dims: Any, start_rank: int = 0) -> None:
        dims = tuple(int(d) for d in dims) + (1,) * (2 - len(dims))
        self.dims, self.start_rank = dims, int(start_rank)

    @property
    def size(self) -> int:
        return self.dims[0] * self.dims[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.dims, self.start_rank) == (
            other.dims,
            other.start_rank,
        )

    def __hash__(self) -> int:
        return hash((self.dims, self.start_rank))

    def __repr__(self) -> str:
        return f"Mesh({self.dims}, {self.start_rank})"


class Shard:
    def __init__(self, dim: int) -> None:
        self.dim = int(dim)


class Replicate:
    pass


class Config:
    def __init__(self, max_cta: int | None = None) -> None:
        self.max_cta = max_cta


class Handle:
    created: list[Handle] = []

    def __init__(self, config: Config | None) -> None:
        self.config, self.destroyed = config, False

    @classmethod
    def create(cls, config: Config | None = None) -> Handle:
        h = cls(config)
        cls.created.append(h)
        return h

    def destroy(self) -> None:
        self.destroyed = True


def _codes(placements: list[Any]) -> tuple[int, ...]:
    return tuple(p.dim if isinstance(p, Shard) else -1 for p in placements)


def reshard(
    src: Any,
    dst: Any,
    comm: Communicator,
    stream: Any = None,
    *,
    src_mesh: Mesh,
    src_placements: list[Any],
    dst_mesh: Mesh,
    dst_placements: list[Any],
    handle: Handle | None = None,
) -> None:
    if handle is None or handle.destroyed:
        raise RuntimeError("fake m2n: reshard without a live handle")
    payload = (src, dst, src_mesh, _codes(src_placements), dst_mesh, _codes(dst_placements))
    _submit(comm.world, comm.world.arrive(comm.rank, "reshard", payload))


@contextlib.contextmanager
def group() -> Iterator[None]:
    group_start()
    try:
        yield
    finally:
        group_end()


def modules() -> dict[str, types.ModuleType]:
    """``nccl``, ``nccl.core``, ``nccl.m2n`` as this module's fakes."""
    me = sys.modules[__name__]
    core = types.ModuleType("nccl.core")
    for name in ("UniqueId", "get_unique_id", "group_start", "group_end", "Communicator"):
        setattr(core, name, getattr(me, name))
    m2n = types.ModuleType("nccl.m2n")
    for name in ("Mesh", "Shard", "Replicate", "Config", "Handle", "reshard", "group"):
        setattr(m2n, name, getattr(me, name))
    top = types.ModuleType("nccl")
    top.__path__ = []  # type: ignore[attr-defined]
    top.core, top.m2n = core, m2n  # type: ignore[attr-defined]
    return {"nccl": top, "nccl.core": core, "nccl.m2n": m2n}


def install() -> None:
    """Put ``modules()`` into ``sys.modules`` (the caller restores what was there)."""
    sys.modules.update(modules())


# -- CuPy's surface for the data plane ------------------------------------------------------------


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    @property
    def done(self) -> bool:
        return drained()

    def __enter__(self) -> _Stream:  # CuPy's: the current stream inside the block
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeXP:
    """What ``NcclM2NDataPlane`` asks of CuPy: devices, streams, an int8 buffer, a copy back."""

    int8 = np.int8

    class cuda:  # CuPy's spelling
        Stream = _Stream

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                return None

    @staticmethod
    def full(shape: Any, value: int, dtype: Any) -> np.ndarray:
        return np.full(shape, value, dtype=dtype)

    @staticmethod
    def asnumpy(a: Any) -> np.ndarray:
        return np.asarray(a)
