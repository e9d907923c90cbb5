"""``TrainerInitInfo``: how a caller configures a trainer engine.

The wire params (``packed``, buffer size, number of buffers) travel to the workers
inside the init info the engine posts, so trainer and worker cannot frame a round
differently. Everything is validated at construction, on every trainer rank, before
any rendezvous starts; a bad value raises ``ConfigError`` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weightwire.backends import (
    ALIASES,
    DEFAULT_BACKEND,
    SPECS,
    backend_names,
    canonical,
    get_backend,
)
from weightwire.backends.base import SenderCaps
from weightwire.shared.checks import check_buffer_size, check_num_buffers
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES, LIMITS
from weightwire.shared.routes import PAUSE_MODES
from weightwire.shared.staging import check_stage_budget
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.version import ServerFeatures
from weightwire.trainer.handoff import round_interval_s
from weightwire.trainer.overlap import MAX_ROUNDS_IN_FLIGHT
from weightwire.trainer.snapshot import SNAPSHOT_MODES


def _takes_patches(caps: SenderCaps) -> bool:
    """A delta round reaches workers of this backend: ours apply patches, a stock receiver
    only where its backend sends them (``caps.delta``)."""
    return not caps.stock_receiver or caps.delta


IPC_ASKED = ("pull", "push", "write_through", "auto")
"""What ``TrainerInitInfo.ipc_mode`` may ask for."""

SLICED_MODES = ("auto", "off")
"""``TrainerInitInfo.sliced``: each worker gets only its slices where that saves bytes, or never."""

DEFAULT_DELTA_DENSITY = 0.25
"""Patch a tensor when under a quarter of it changed (a bf16 patch breaks even at 1/3)."""


@dataclass(kw_only=True)
class TrainerInitInfo:
    """Trainer-side configuration.

    - ``backend``: ``nccl`` (stock vLLM dense NCCL, unique-id rendezvous, vLLM >= 0.30),
      ``nccl_m2n`` (vLLM 0.33's own: every trainer device sends its own shard, resharded
      into the workers' layout; ``docs/sliced.md``),
      ``weightwire_nccl`` (the same plus a worker-side timeout; needs the weightwire
      plugin), ``weightwire_tcp`` (no GPU needed; needs the plugin), ``weightwire_ipc``
      (trainer and workers on one host, CUDA IPC; needs the plugin).
    - ``rank``: this trainer process's rank; rank 0 sends, the others only iterate the
      source so they stay in the trainer-side gathers (FSDP ``full_tensor``).
    - ``packed`` / ``packed_buffer_size_bytes`` / ``packed_num_buffers``: wire params.
    - ``tcp_bind_host`` / ``tcp_advertise_host``: where the TCP rendezvous (and
      ``nccl_m2n``'s metadata store) listens and the address workers dial (set it when
      workers are on other hosts).
    - ``device``: CUDA ordinal of the NCCL sender (``None``: the current device).
    - ``pause_mode``: pause generation around every round (``keep``/``wait``/``abort``).
      The default ``auto`` pauses with ``keep`` around rounds to a stock ``nccl`` worker
      whenever the client can pause (a round run under live traffic crashes vLLM: its
      layerwise reload puts layers on the meta device mid-round). To a plugin backend, ``auto``
      pauses with ``abort`` (new requests refused, HTTP 503) around a round over
      ``stage_budget_bytes`` (applied in place) and resumes only once it committed: a round
      that fails leaves the servers refusing until a complete round commits. A staged round's
      transfer is not paused (only its commit and cache reset, see ``reset_prefix_cache``).
      ``None`` never pauses.
    - ``reset_prefix_cache``: after every committed round, reset every server's prefix
      cache (running requests are preempted and recompute their KV with the new weights)
      and encoder cache, right after the commit and before a paused round resumes
      (``trainer.freshness``). ``False``: vLLM may
      answer a prompt whose prefix it cached before the round from KV computed with the
      previous weights; only for users who knowingly accept that.
    - ``ipc_release_after_round``: ``weightwire_ipc`` frees its slots after every round
      (the memory goes back to training; handles are re-exported next round); in pull
      mode the workers free their receive buffers instead.
    - ``ipc_mode``: ``weightwire_ipc``'s data path for packed rounds. ``auto`` (default):
      write-through where it is correct, else pull, chosen at the join: every worker says
      in its hello whether its model can be written through (its landing map records and
      its post-load processing is a no-op); one that cannot (a loader that computes, a
      quantized or CPU-prepacked layer, a model that applies rounds between its own hooks)
      makes the session pull, and the trainer logs one line naming the worker and why; a
      session with ``delta`` pulls (one log line). ``write_through`` (the trainer writes
      each tensor straight into the workers' serving parameters, where their loader puts
      it: one copy per byte, no receive buffer; every round is applied in place, so
      generation is refused around it as ``pause_mode`` says; a worker whose loader is
      not a plain copy takes its rounds as in pull and logs why), ``pull`` (the trainer
      writes straight into the workers' receive buffers, one device copy per byte, no
      slots kept; the worker then loads them) or ``push`` (the slot ring: two copies).
      A mode asked for explicitly is the one used; a worker that predates a mode gets the
      next one; every unpacked session gets push.
    - ``stage_budget_bytes``: the plugin backends' workers stage a round of at most this
      many bytes (received whole into fresh memory, applied at finish: all or nothing) and
      apply a larger one in place as its bytes land (``0``: always in place). A round applied
      in place is guarded by ``pause_mode`` (see there); the worker's extra memory for a round
      is its receive buffers plus this budget, whatever the model's size.
    - ``delta``: ``"off"`` (default) or ``"auto"``: send only what changed since the last
      committed round (``docs/delta.md``). Rank 0 keeps one copy of the model on its device
      (the workers' weights) and finds the changed elements there; per tensor, a patch (flat
      ``int32`` indices + values) below ``delta_density`` of its elements changed, the tensor
      dense at or above it, nothing if it did not change. Needs a ``weightwire_*`` backend
      or ``sparse_nccl`` (vLLM's receiver of patches only: a tensor sent dense is a patch of
      every element; ``docs/vllm-compat.md``) and one sender (no ``TrainerGroup``); draft
      rounds stay dense.
    - ``delta_density``: the per-tensor changed fraction below which a tensor is patched
      (``0 < delta_density <= 1``; a bf16 patch costs 6 bytes per changed element against
      2 dense, so past 1/3 a patch is larger than the tensor; a tensor whose patch would not
      be smaller than it goes dense whatever the density: an e4m3 weight from 1/5 changed).
    - ``delta_anchor_every``: with ``delta``, every N-th round is dense (``0``: only the
      first, a forced one and the one after a failure).
    - ``sliced``: ``"auto"`` (default) or ``"off"``. With ``auto``, a backend that offers it
      (``weightwire_tcp``, ``weightwire_nccl``) asks each worker at init which part of every
      tensor it serves (its wants, from its landing map); when some worker wants less than a
      whole tensor (tensor parallelism), every dense round sends each worker only its slices,
      read from the shards the trainer holds (``docs/sliced.md``); when every worker wants every
      tensor whole the rounds are broadcasts as before. ``off``: always broadcast.
    - ``timeouts``: every wait's bound (default: ``Timeouts.from_env()``, so
      ``WEIGHTWIRE_TIMEOUT_<FIELD>`` variables apply).
    - ``partial``: the rounds leave some of the served model's tensors out on purpose (frozen
      layers). Where the server said at init which tensors its model takes
      (``shared.served``), every round is checked against them before its first byte: a
      tensor it lacks, or of another dtype or shape, is refused always; a missing one is
      refused unless ``partial=True`` (an adapter round is never "missing" anything). A
      sliced round is also checked against each worker's wants: a tensor a worker reads
      that the round lacks is refused unless ``partial=True``.
    - ``served_checkpoint``: for a server that does not tell (stock vLLM: the ``nccl`` and
      ``sparse_nccl`` backends, or the plugin backends under vLLM's own routes), the directory
      of the checkpoint it serves (a local copy: its ``*.safetensors`` headers and
      ``config.json`` are read at ``trainer_init``); rounds are then checked against its names
      and shapes, not dtypes (vLLM casts on load). A server that tells wins.
    - ``verify``: after each round, compare the servers' per-tensor sha256 with what
      was sent (costs a host copy of every tensor; a debugging aid).
    - ``max_rounds_in_flight``: how many ``send_weights(wait=False)`` rounds may be in flight
      (queued or running) at once; the next call waits for a slot. ``1`` (default): a round
      starts only once the previous one ended, so rollouts run at most one round behind.
    - ``snapshot``: how ``send_weights(wait=False)`` fixes the weights it sends. ``"copy"``
      (default): the torch engine copies every tensor into reusable buffers on its device
      (one set per round in flight: a model's size each) before returning; ``"none"``: no
      copy, the caller promises not to write the parameters until the round's handle is
      done; ``"cow"``: no copy up front, a torch optimizer's ``step`` (or
      ``before_update()``) copies what the round has not read yet, any other in-place write
      fails the round with ``SnapshotChanged`` (``torch_side.sender.cow``). JAX arrays are
      immutable: the JAX engine references them in every mode.
    - ``server_version`` / ``inference_world_size``: for clients that cannot ask the
      server (a custom adapter with only the four calls). A client that can ask is
      still asked, and a ``server_version`` naming another release is refused.
    - ``inference_tensor_parallel_size``: ``nccl_m2n`` only: the servers'
      ``--tensor-parallel-size``, so the workers are declared as ``(world / tp, tp)`` and vLLM
      writes each tensor it can place straight into each worker's slice (``None``: 1, every
      tensor reaches every worker whole; a wrong value is refused by vLLM's plan checks or
      falls back to whole tensors, never lands wrong).
    - ``version_override``: gate the server as this known vLLM release (``"0.33"``)
      whatever it reports: the explicit way past a fail-closed gate (a pre-release or
      a version newer than weightwire knows). Logged at every init.
    """

    backend: str = DEFAULT_BACKEND
    rank: int = 0
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeouts: Timeouts = field(default_factory=Timeouts.from_env)
    tcp_bind_host: str = "127.0.0.1"
    tcp_advertise_host: str | None = None
    device: int | None = None
    pause_mode: str | None = "auto"
    reset_prefix_cache: bool = True
    verify: bool = False
    partial: bool = False
    served_checkpoint: str | None = None
    max_rounds_in_flight: int = 1
    snapshot: str = "copy"
    server_version: str | None = None
    inference_world_size: int | None = None
    inference_tensor_parallel_size: int | None = None
    version_override: str | None = None
    ipc_release_after_round: bool = False
    ipc_mode: str = "auto"
    stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES
    delta: str = "off"
    delta_density: float = DEFAULT_DELTA_DENSITY
    delta_anchor_every: int = 0
    sliced: str = "auto"

    def __post_init__(self) -> None:
        # Runtime-registered backends (register_backend) count too.
        # The same spellings as the command line (``tcp``): one alias table,
        # weightwire.backends.ALIASES.
        self.backend = canonical(self.backend) if isinstance(self.backend, str) else self.backend
        if self.backend not in backend_names():
            aliases = ", ".join(f"{alias} = {name}" for alias, name in ALIASES.items())
            raise ConfigError(
                f"unknown backend {self.backend!r}; known: {', '.join(backend_names())} "
                f"(aliases: {aliases})"
            )
        if type(self.rank) is not int or self.rank < 0:
            raise ConfigError(f"rank must be a non-negative int, got {self.rank!r}")
        if type(self.packed) is not bool:
            raise ConfigError(f"packed must be a bool, got {self.packed!r}")
        check_buffer_size("packed_buffer_size_bytes", self.packed_buffer_size_bytes)
        check_num_buffers("packed_num_buffers", self.packed_num_buffers)
        if not isinstance(self.timeouts, Timeouts):
            raise ConfigError(
                f"timeouts must be a weightwire Timeouts, got {type(self.timeouts).__name__}"
            )
        # A bad WEIGHTWIRE_SWITCH_INTERVAL_US fails here, before anything is sent.
        round_interval_s()
        if type(self.ipc_release_after_round) is not bool:
            raise ConfigError(
                f"ipc_release_after_round must be a bool, got {self.ipc_release_after_round!r}"
            )
        check_stage_budget("stage_budget_bytes", self.stage_budget_bytes)
        if type(self.partial) is not bool:
            raise ConfigError(f"partial must be a bool, got {self.partial!r}")
        checkpoint = self.served_checkpoint
        if checkpoint is not None and not (isinstance(checkpoint, str) and checkpoint):
            raise ConfigError(
                f"served_checkpoint must be a directory path (str) or None, got {checkpoint!r}"
            )
        if type(self.reset_prefix_cache) is not bool:
            raise ConfigError(f"reset_prefix_cache must be a bool, got {self.reset_prefix_cache!r}")
        if self.ipc_mode not in IPC_ASKED:
            raise ConfigError(
                f"ipc_mode must be one of {', '.join(map(repr, IPC_ASKED))}, got {self.ipc_mode!r}"
            )
        if self.pause_mode is not None and self.pause_mode not in ("auto", *PAUSE_MODES):
            raise ConfigError(
                f"pause_mode must be None, 'auto' or one of {PAUSE_MODES}, got {self.pause_mode!r}"
            )
        if self.device is not None and (type(self.device) is not int or self.device < 0):
            raise ConfigError(
                f"device must be a CUDA ordinal (int >= 0) or None, got {self.device!r}"
            )
        if self.version_override is not None:
            ServerFeatures.for_version(
                "0.0", override=self.version_override
            )  # an unknown release fails here
        rounds = self.max_rounds_in_flight
        if type(rounds) is not int or not 1 <= rounds <= MAX_ROUNDS_IN_FLIGHT:
            raise ConfigError(
                f"max_rounds_in_flight must be an int in 1..{MAX_ROUNDS_IN_FLIGHT}, got {rounds!r}"
            )
        if self.snapshot not in SNAPSHOT_MODES:
            raise ConfigError(f"snapshot must be one of {SNAPSHOT_MODES}, got {self.snapshot!r}")
        world = self.inference_world_size
        if world is not None and (type(world) is not int or not 1 <= world < LIMITS.max_world_size):
            raise ConfigError(f"inference_world_size must be a positive int, got {world!r}")
        tp = self.inference_tensor_parallel_size
        if tp is not None and (type(tp) is not int or not 1 <= tp < LIMITS.max_world_size):
            raise ConfigError(f"inference_tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.sliced not in SLICED_MODES:
            raise ConfigError(
                f"sliced must be one of {', '.join(map(repr, SLICED_MODES))}, got {self.sliced!r}"
            )
        self._check_delta()

    def _check_delta(self) -> None:
        if self.delta not in ("off", "auto"):
            raise ConfigError(f"delta must be 'off' or 'auto', got {self.delta!r}")
        density = self.delta_density
        if type(density) not in (int, float) or not 0 < density <= 1:
            raise ConfigError(f"delta_density must be in (0, 1], got {density!r}")
        anchor = self.delta_anchor_every
        if type(anchor) is not int or anchor < 0:
            raise ConfigError(f"delta_anchor_every must be an int >= 0, got {anchor!r}")
        caps = get_backend(self.backend).caps
        if self.delta != "off" and caps.stock_receiver and not caps.delta:
            takers = (n for n in SPECS if _takes_patches(get_backend(n).caps))
            raise ConfigError(
                f"delta={self.delta!r} needs a backend whose workers take patches "
                f"({', '.join(takers)}): a stock vLLM worker ({self.backend!r}) cannot apply them"
            )
        get_backend(self.backend).check_config(self, delta=self.delta)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0
