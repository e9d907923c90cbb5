"""``HFModelHost``: a transactional ``load_weights`` over a Hugging Face transformers model.

The reference server's stand-in for vLLM's model: the engine hands it
``(hf_name, tensor)`` batches during a round; they are *staged*, validated on
arrival, and copied into the parameters only at ``commit_round``. A round that fails
midway (``abort_round``) therefore leaves the served weights exactly as they were,
never a mix of two versions (a delta round's patches are staged with it and applied
after its dense tensors, ``patch_weights``). A round opened with ``begin_in_place_round`` (the
engines' streaming strategy) instead copies each tensor into its parameter as it
arrives, holding nothing; a failure then leaves the model part new, which the engine
records (``weight_state.WeightState``) and the server refuses to serve.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import torch

from weightwire.shared.delta import Patch
from weightwire.shared.meta import ParamMeta
from weightwire.shared.served import ServedModel
from weightwire.torch_side.dtypes import torch_dtype, wire_name

if TYPE_CHECKING:  # the delta module is imported by a delta round only
    from weightwire.torch_side.worker.delta import StagedPatch


class _Engine(Protocol):
    def shutdown(self) -> None: ...


class _Host(Protocol):
    def abort_round(self) -> None: ...


def close_engine(engine: _Engine | None, host: _Host) -> None:
    """A replica's teardown (the reference server's worker, the Ray test replica): shut its
    transfer engine down (None: it had none; this aborts an open round), then drop what
    ``host`` staged. The served weights stay."""
    if engine is not None:
        engine.shutdown()
    host.abort_round()


class HFModelHost:
    """Stages and commits weight rounds into ``hf_model``'s parameters.

    Names are the model's ``named_parameters()`` names (the HF checkpoint names).
    A tied alias (``lm_head.weight`` when tied to the input embeddings) is accepted
    and lands in the shared parameter; sending both names in one round is allowed
    only with identical values.

    A dtype that differs from the parameter's is refused, because a silent cast would
    make the served weights differ from the trainer's bytes. ``cast_to_param_dtype=True``
    accepts it and casts at commit (lossy when narrowing, e.g. float32 -> bfloat16).

    ``load_weights`` keeps references to the tensors it is given until the round
    ends; callers must not reuse their memory meanwhile (the weightwire engines hand
    over freshly allocated chunk buffers).
    """

    transactional_rounds = True
    """A ``begin_round`` .. ``commit_round`` round is all-or-nothing (see
    ``strategy.StagedRound``)."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        *,
        cast_to_param_dtype: bool = False,
        write_lock: threading.Lock | None = None,
    ) -> None:
        if not isinstance(hf_model, torch.nn.Module):
            raise TypeError(f"HFModelHost needs a torch.nn.Module, got {type(hf_model).__name__}")
        self.model = hf_model
        self.cast_to_param_dtype = cast_to_param_dtype
        self._params: dict[str, torch.nn.Parameter] = dict(hf_model.named_parameters())
        # alias name -> canonical (first) name of the same Parameter object
        canonical = {id(p): n for n, p in self._params.items()}
        self._alias: dict[str, str] = {
            name: canonical[id(p)] for name, p in hf_model.named_parameters(remove_duplicate=False)
        }
        self._tied = any(a != c for a, c in self._alias.items())
        self._stage: dict[str, torch.Tensor] | None = None
        self._patches: list[StagedPatch] = []
        """A staged round's patches, applied at commit after its dense tensors."""
        self._lock = threading.Lock()
        self._write_lock = write_lock
        """Held around each in-place write of a receive: whoever reads the parameters
        (generation) holds it too. ``commit_round`` does not take it: its caller owns it for
        the whole commit (the server's finish), one owner per operation."""
        self._in_place = False
        self._written: set[str] = set()
        """Canonical names an in-place round wrote so far."""
        self.rounds_committed = 0
        self.last_committed: frozenset[str] = frozenset()
        """Canonical names the last committed round wrote."""

    # ------------------------------------------------------------------ round
    @property
    def in_round(self) -> bool:
        return self._stage is not None or self._in_place

    @property
    def in_place_round(self) -> bool:
        """A round is being applied in place: the parameters are a mix until it commits."""
        return self._in_place

    def begin_round(self) -> None:
        with self._lock:
            if self.in_round:
                raise RuntimeError(
                    "HFModelHost: begin_round while a round is open; commit or abort it first"
                )
            self._stage = {}
            self.last_committed = frozenset()

    def begin_in_place_round(self) -> None:
        """Open a round whose tensors go straight into the parameters (no staging copy)."""
        with self._lock:
            if self.in_round:
                raise RuntimeError(
                    "HFModelHost: begin_in_place_round while a round is open; commit "
                    "or abort it first"
                )
            self._in_place = True
            self._written = set()
            self.last_committed = frozenset()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Validate and stage ``(name, tensor)`` pairs; returns the canonical names staged.

        Raises ``ValueError`` naming the tensor for an unknown name, a shape or dtype
        mismatch, or a conflicting duplicate. The round stays open: the engine
        decides to abort it.
        """
        if self._in_place:
            return self._write_in_place(weights)
        with self._lock:
            if self._stage is None:
                raise RuntimeError(
                    "HFModelHost: load_weights outside a round; call begin_round first"
                )
            staged: set[str] = set()
            for name, tensor in weights:
                key = self._check(name, tensor)
                previous = self._stage.get(key)
                if previous is not None and not torch.equal(previous, tensor):
                    raise ValueError(
                        f"HFModelHost: {name!r} received twice in one round with different values"
                        + (f" (alias of {key!r})" if key != name else "")
                    )
                self._stage[key] = tensor.detach()
                staged.add(key)
            return staged

    def check_patches(self, patches: Iterable[Patch]) -> None:
        """Raise ``ValueError`` naming the first patched tensor the model does not hold
        with that shape and dtype (before any byte of the round)."""
        for p in patches:
            self._check(p.name, torch.empty(p.shape, dtype=torch_dtype(p.dtype), device="meta"))

    def patch_weights(self, patches: Sequence[StagedPatch]) -> None:
        """A delta round's patches: held and applied after the round's dense tensors at
        ``commit_round``, staged or in place alike (the caller of ``commit_round`` owns the
        write lock for the whole commit: a write here that took it again would deadlock
        the finish that holds it). Refused with ``ValueError`` before any is held: indices
        out of range or not strictly increasing, or both names of a tied tensor patched
        with different values."""
        from weightwire.torch_side.worker.delta import check_indices, check_tied

        check_indices(patches)
        check_tied(patches, self.tied_aliases())
        with self._lock:
            if not self.in_round:
                raise RuntimeError("HFModelHost: patch_weights outside a round")
            self._patches.extend(patches)

    def _patch(self, patches: Sequence[StagedPatch]) -> None:
        """Write the held patches into their parameters (the caller holds the lock)."""
        if not patches:  # a dense round: the delta module stays unimported
            return
        from weightwire.torch_side.worker.fused_patch import FusedPatch, PatchTarget, apply_fused

        fused: list[FusedPatch] = []
        flats: dict[str, torch.Tensor] = {}
        for p in patches:
            name = self._alias[p.name]
            param = self._params[name].data
            if p.values.dtype != param.dtype:  # checked on receipt (check_patches): a guard
                raise ValueError(f"patch values are {p.values.dtype}, the tensor is {param.dtype}")
            flats[name] = param.view(-1)
            fused.append(FusedPatch(PatchTarget(name, 0), p.index, p.values, p.name))
        with torch.no_grad():  # one scatter per parameter, the indices prepared together
            apply_fused(flats, fused)

    def tied_aliases(self) -> dict[str, str]:
        """``{alias: canonical}`` of the model's tied parameters (``lm_head.weight`` ->
        ``model.embed_tokens.weight``)."""
        return {a: c for a, c in self._alias.items() if a != c}

    def check_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise ``ValueError`` naming the first tensor ``load_weights`` would refuse."""
        for name, tensor in weights:
            self._check(name, tensor)

    def _write_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        pairs = [
            (self._check(name, tensor), tensor) for name, tensor in weights
        ]  # the whole batch checked first
        with (
            self._write_lock if self._write_lock is not None else nullcontext(),
            self._lock,
            torch.no_grad(),
        ):
            for key, tensor in pairs:
                self._params[key].copy_(tensor)
            self._written.update(key for key, _ in pairs)
        return {key for key, _ in pairs}

    def _check(self, name: str, tensor: torch.Tensor) -> str:
        key = self._alias.get(name)
        if key is None:
            sample = ", ".join(list(self._params)[:3])
            raise ValueError(
                f"HFModelHost: unknown weight name {name!r} (model has {len(self._params)} "
                f"parameters, e.g. {sample})"
            )
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"HFModelHost: {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        param = self._params[key]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"HFModelHost: {name!r} has shape {list(tensor.shape)}, the parameter has "
                f"{list(param.shape)}"
            )
        if tensor.dtype != param.dtype and not self.cast_to_param_dtype:
            raise ValueError(
                f"HFModelHost: {name!r} has dtype {tensor.dtype}, the parameter has {param.dtype}; "
                f"refusing a silent cast: cast the trainer's source to {param.dtype}"
            )
        return key

    def commit_round(self) -> int:
        """Copy every staged tensor into its parameter; returns how many were applied."""
        with self._lock:
            if self._in_place:
                # The dense tensors are in already; the held patches go in now, under the
                # same lock discipline as a staged commit.
                self._in_place = False
                patches, self._patches = self._patches, []
                self._patch(patches)
                self.rounds_committed += 1
                self.last_committed = frozenset(self._written) | {
                    self._alias[p.name] for p in patches
                }
                self._written = set()
                return len(patches)
            if self._stage is None:
                raise RuntimeError("HFModelHost: commit_round without begin_round")
            stage, self._stage = self._stage, None
            patches, self._patches = self._patches, []
            with torch.no_grad():
                for key, tensor in stage.items():
                    self._params[key].copy_(tensor)
                self._patch(patches)
                if self._tied:
                    self._retie()
            self.rounds_committed += 1
            self.last_committed = frozenset(stage) | {self._alias[p.name] for p in patches}
            return len(stage) + len(patches)

    def staged_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors staged for the open round, not yet in the parameters."""
        with self._lock:
            return list((self._stage or {}).items())

    def round_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The open round's dense tensors, not yet committed: staged, or (a round applied in
        place) the parameters it wrote, read where they are (a check before the commit,
        ``--check-finite``, sees what the round would serve)."""
        with self._lock:
            if self._in_place:
                return [(key, self._params[key].data) for key in sorted(self._written)]
            return list((self._stage or {}).items())

    def abort_round(self) -> None:
        """Drop the staged tensors; the parameters are untouched (an in-place round's
        writes stay: the engine records the model as incomplete). Safe without a round."""
        with self._lock:
            self._stage = None
            self._patches = []
            self._in_place = False
            self._written = set()

    def _retie(self) -> None:
        # copy_ writes into the shared Parameter, so ties survive; this guards
        # against code that replaced one side of a tie with a new Parameter.
        for name, param in self.model.named_parameters(remove_duplicate=False):
            key = self._alias.get(name)
            tie = getattr(self.model, "tie_weights", None)  # transformers' PreTrainedModel method
            if key is not None and param is not self._params[key] and tie is not None:
                tie()
                return

    # ------------------------------------------------------------- inspection
    def param_names(self) -> list[str]:
        return list(self._params)

    def served_model(
        self, shape_of: Callable[[torch.nn.Parameter], tuple[int, ...] | None] | None = None
    ) -> ServedModel:
        """The checkpoint tensors this model takes (its parameters, wire dtypes, shapes) and
        its tied aliases, and the linears it holds in FP8 (its config's
        ``quantization_config``): what the trainer checks each round against before any byte.
        ``shape_of``: a parameter's shape where its own is not it (a level-2 sleep left it
        empty until the wake; the trainer's rounds are checked against the model's shapes)."""

        def shape(p: torch.nn.Parameter) -> tuple[int, ...]:
            told = shape_of(p) if shape_of is not None else None
            return tuple(p.shape) if told is None else told

        return ServedModel.of(
            (ParamMeta(n, wire_name(p.dtype), shape(p)) for n, p in self._params.items()),
            {a: c for a, c in self._alias.items() if a != c},
            quantization_config=quantization_config(self.model),
        )

    def state_checksums(self) -> dict[str, str]:
        """``{hf_name: sha256 hex of the parameter's raw C-order bytes}`` (tied aliases once)."""
        with self._lock:
            return {name: tensor_sha256(p) for name, p in self._params.items()}


def quantization_config(model: torch.nn.Module) -> dict[str, object] | None:
    """The HF config's ``quantization_config`` as a dict (transformers keeps a dict or a
    ``QuantizationConfigMixin``), ``None`` without one."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        config = to_dict()
    return config if isinstance(config, dict) else None


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw little-endian C-order bytes (any dtype, bf16 included)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()
