"""Every exception weightwire raises derives from ``WeightwireError``.

The tree (indent = subclass; builtin mixins in parentheses; ``[module]`` where a class is
defined outside this module)::

    WeightwireError
      ConfigError (ValueError)
        SourceMismatch
        WrongType (TypeError)
        NotInitialized (RuntimeError)
        NamingError                          [weightwire.jax_side.transforms]
        CheckpointError                      [weightwire.jax_side.checkpoint]
        PlanError                            [weightwire.trainer.broadcast_plan]
        SliceError                           [weightwire.shared.slices]
        SlicePlanError                       [weightwire.trainer.slice_plan]
        StockRefusal                         [weightwire.backends.base]
        SparseBaseUnknown                    [weightwire.trainer.patch_round]
        AdapterRefused                       [weightwire.trainer.lora]
        ServedModelMismatch                  [weightwire.shared.served]
        QuantizationError                    [weightwire.shared.quant]
        NotAdvertised (RuntimeError)         [weightwire.control.client]
      TransferError (RuntimeError)
        TransferTimeout (TimeoutError)
        PeerLost (ConnectionError)
        RoundAborted                         [weightwire.backends.base]
        StoreError                           [weightwire.backends.nccl.m2n_store]
      WeightSyncError (RuntimeError)
        ControlTimeout (TimeoutError)
        ServerNotReady (TimeoutError)        [weightwire.control.ready]
        AdapterUnloaded                      [weightwire.trainer.lora]
      RoundError
        DeltaBaseMismatch (RuntimeError)
        EngineBroken (RuntimeError)          [weightwire.trainer.engine]
        RoundFailed (RuntimeError)           [weightwire.trainer.multi_base]
        GroupTimeout (TimeoutError)          [weightwire.trainer.group]
        RoundSkipped (RuntimeError)          [weightwire.trainer.overlap]
        RoundWaitTimeout (TimeoutError)      [weightwire.trainer.overlap]
        RoundCancelled (RuntimeError)        [weightwire.trainer.snapshot]
        SnapshotChanged (RuntimeError)       [weightwire.trainer.snapshot]
      VerifyError (RuntimeError)             [weightwire.trainer.verify]
      StaleCacheError (RuntimeError)         [weightwire.trainer.freshness]
      WeightReceiveError (RuntimeError)      [weightwire.torch_side.worker.core]
      LoaderMapRefused                       [weightwire.torch_side.worker.landing_trace]
      UnavailableError
        MissingExtra (ModuleNotFoundError)   [weightwire._extras]
        NCCLUnavailable (RuntimeError)       [weightwire.backends.nccl.library]
        IPCUnavailable (RuntimeError)        [weightwire.backends.ipc.slots]
      ReferenceServerError
        ApiError                             [weightwire.tools.server.web]
          ClientGone                         [weightwire.tools.server.web]
          BodyTooLarge                       [weightwire.tools.server.web]
          NothingToReuse                     [weightwire.tools.server.weight_rules]
        SessionError                         [weightwire.tools.server.session]
        ReplicaError                         [weightwire.tools.server.replica]
        FanOutError                          [weightwire.tools.server.replicas]
        GenerationAborted                    [weightwire.tools.server.failures]
        CommitAborted                        [weightwire.tools.server.failures]
        NonFiniteRound (ValueError)          [weightwire.tools.server.guards]
        NonFiniteOutput                      [weightwire.tools.server.generate]
        WeightsUnavailable                   [weightwire.tools.server.sleep]
        SleepCancelled                       [weightwire.tools.server.sleep]
        ModelIncomplete                      [weightwire.tools.server.failures]
        CompletionRequestError (ValueError)  [weightwire.tools.server.completions]
      CommandError                           [weightwire.tools._cli]
      RolloutError (RuntimeError)            [weightwire.tools.demo.rollout]
      ChildError (RuntimeError)              [weightwire.tools.demo.server]
      WireShort                              [weightwire.backends.tcp.wire]
      _NoOrder                               [weightwire.backends.nccl.stock]

What to catch:

- ``ConfigError`` (a ``ValueError``): fix your input (an init info, a naming, a source,
  a backend that cannot carry a tensor). Nothing was sent; retrying cannot help.
- ``WeightSyncError``: a server refused a call (``status`` is its HTTP status) or did not
  answer (``status is None``; ``ControlTimeout`` for the engine's own bound).
- ``TransferError``, ``RoundError``, ``WeightSyncError`` with ``status`` ``None`` / 5xx:
  the round failed and the server kept its previous weights; retry the round (after a
  mid-transfer failure the engine is ``EngineBroken``: ``shutdown()`` and ``trainer_init()`` again).
- ``UnavailableError``: this machine lacks a package, CuPy or a CUDA device; install it
  or pick another backend.
- ``WeightwireError``: anything weightwire raised on purpose (anything else is a bug).

Where each class lives: the classes every layer raises or catches (the contract's data
plane and control plane errors, ``ConfigError``, ``SourceMismatch``) are defined here; a
class used by one layer only stays in that layer's module, deriving from its branch here.
Each class also derives from the builtin exception that describes it (a ``StockRefusal`` is
a ``ValueError``, ``PeerLost`` a ``ConnectionError``, ``ControlTimeout`` both a
``WeightSyncError`` and a ``TimeoutError``), so one ``except WeightSyncError`` covers every
control-plane failure and handlers written for the builtins catch weightwire's too.
``tests/shared/test_errors.py`` checks that this tree matches the code.

numpy-free and imports nothing else of weightwire: every layer can import it.
"""

from __future__ import annotations

from typing import Any

INTERNAL_BRANCHES = (
    "ReferenceServerError",
    "CommandError",
    "RolloutError",
    "ChildError",
    "WireShort",
    "_NoOrder",
)
"""Classes (with their subclasses) that never reach a library user's code: the reference server
turns its own into HTTP replies, the command line's become its one error line, and two are
private to one module. ``docs/errors.md`` shows the tree without them."""


class WeightwireError(Exception):
    """The root: raised only by weightwire; catch it to handle every failure it reports."""


class ConfigError(WeightwireError, ValueError):
    """Bad user input (init info, naming, source, plan); fix the input, nothing was sent."""


class SourceMismatch(ConfigError):
    """Iteration disagreed with ``metadata()``; fix the source.

    Raised before the bad tensor is sent.
    """


class WrongType(ConfigError, TypeError):
    """A user's argument of the wrong kind (an init info that is not a ``TrainerInitInfo``, a
    client lacking a route the configuration needs); the message names what was expected.

    Also a ``TypeError``, which such a mistake raised before it had a class of its own.
    """


class NotInitialized(ConfigError, RuntimeError):
    """A call made before the set-up it needs (a ``JaxProcessGroup`` before
    ``jax.distributed.initialize()``, a ``TorchStoreGroup`` with neither a store nor
    ``torch.distributed.init_process_group``); the message names the step to run first.

    Also a ``RuntimeError``, which such a call raised before it had a class of its own.
    """


class TransferError(WeightwireError, RuntimeError):
    """The data plane failed (a peer lost or refused, a wait timed out).

    The round failed; re-init and retry.
    """


class TransferTimeout(TransferError, TimeoutError):
    """A wait exceeded its timeout; the communicator has been aborted: retry with a fresh engine."""


class PeerLost(TransferError, ConnectionError):
    """A peer disconnected; the message names the peer and the byte offset: retry the round."""


class WeightSyncError(WeightwireError, RuntimeError):
    """A weight-sync call failed on one server: it refused (``status``) or did not answer.

    ``route`` is the route name (``update_weights``), ``status`` the HTTP status (or
    ``None`` when no response arrived: connection refused, timeout), ``message`` the
    server's own error text, ``server`` the base URL (or actor) that failed. ``pause``: what a
    refused start that carried the round's pause says became of it, a field of the error
    body beside the message (``routes.START_PAUSE_FIELD``: ``"none"``, ``"undone"`` or
    ``"held"``); ``None`` where the reply carries none. ``refusal``: the worker's refusal
    named as a field of the error body (``routes.REFUSAL_FIELD``, e.g.
    ``DELTA_BASE_MISMATCH``), for the trainer to read instead of the message's words;
    ``None`` where the reply carries none (stock vLLM: only the message).
    """

    pause: str | None = None
    refusal: str | None = None

    def __init__(
        self,
        route: str,
        status: int | None,
        message: str,
        server: str,
        *,
        pause: str | None = None,
        refusal: str | None = None,
    ) -> None:
        self.route = route
        self.status = status
        self.message = message
        self.server = server
        self.pause = pause
        self.refusal = refusal
        where = f"status {status}" if status is not None else "no response"
        super().__init__(f"{route} failed on {server} ({where}): {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the exception copyable by concurrent.futures / logging machinery.
        return (
            type(self),
            (self.route, self.status, self.message, self.server),
            {"pause": self.pause, "refusal": self.refusal},
        )


class ControlTimeout(WeightSyncError, TimeoutError):
    """A control-plane call (init / update POST) did not answer within ``Timeouts.http_s``.

    A ``WeightSyncError`` with ``status`` ``None`` (no answer), so one ``except
    WeightSyncError`` covers every control-plane failure; its message is the engine's own
    text (``"<what> did not return within <s> s"``), without the server prefix.
    """

    def __init__(self, message: str, *, route: str = "", server: str = "") -> None:
        self.route, self.status, self.message, self.server = route, None, message, server
        Exception.__init__(self, message)  # not WeightSyncError's "<route> failed on ..." text

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,), {"route": self.route, "server": self.server})


class RoundError(WeightwireError):
    """A round failed on the trainer side (a broken engine, a failed or silent rank).

    Re-init, then retry it.
    """


DELTA_BASE_MISMATCH = "DeltaBaseMismatch"
"""How a worker's refusal starts; the value of the reference server's error-body field
``routes.REFUSAL_FIELD`` for it (``WeightSyncError.refusal``), and the marker a trainer looks
for in the error text of a server that carries no such field (stock vLLM with the plugin:
vLLM answers a worker's exception as its own error, with the message only)."""


class DeltaBaseMismatch(RoundError, RuntimeError):
    """A worker refused a delta round: its patches were built on a round it does not hold.

    Raised by the worker before any byte of the round is received; its message starts with
    the class name (``DELTA_BASE_MISMATCH``) so a trainer recognises it in the server's
    error text (``is_delta_base_mismatch``). The trainer engine answers it by sending the
    same round dense, within the same ``send_weights`` call.
    """

    def __init__(self, delta_base: str, held: str | None) -> None:
        self.delta_base = delta_base
        self.held = held
        super().__init__(
            f"{DELTA_BASE_MISMATCH}: the round's patches were built on round {delta_base!r} "
            f"but this worker holds round {held!r}; send the round dense"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.delta_base, self.held))


def is_delta_base_mismatch(exc: BaseException) -> bool:
    """``exc`` is a worker's ``DeltaBaseMismatch``, raised here or carried by a server's
    error (a ``WeightSyncError``, directly or as the cause of another error): in its body's
    field (``refusal``, the reference server) or, where the body has none (stock vLLM, whose
    plugin path passes only the worker's message through), in its words."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, DeltaBaseMismatch):
            return True
        if isinstance(current, WeightSyncError) and (
            current.refusal == DELTA_BASE_MISMATCH
            if current.refusal is not None
            else DELTA_BASE_MISMATCH in current.message
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


class UnavailableError(WeightwireError):
    """This machine lacks something (a package, CuPy, a CUDA device).

    Install it or pick another backend.
    """


class ReferenceServerError(WeightwireError):
    """Raised inside the reference server and turned into its HTTP reply.

    A trainer sees a ``WeightSyncError``.
    """
