"""ModuleSource on plain (single-process) modules: names, order, dtypes, ties, buffers."""

from __future__ import annotations

import pytest
import torch

from weightwire.shared.errors import ConfigError, SourceMismatch
from weightwire.shared.groups import layerwise_groups
from weightwire.shared.source import WeightSource, checked_iter
from weightwire.torch_side.sender.source import ModuleSource, describe_tensor

from ._tiny import tiny_llama


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.BatchNorm1d(4) for _ in range(2)])
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.head = torch.nn.Linear(4, 2)


def test_plain_module_matches_named_parameters_and_checked_iter():
    model = tiny_llama(seed=0)
    src = ModuleSource(model)
    assert isinstance(src, WeightSource)
    metas = src.metadata()
    params = list(model.named_parameters())
    assert [m.name for m in metas] == [n for n, _ in params]
    assert all(
        m.dtype == "float32" and m.shape == tuple(p.shape)
        for m, (_, p) in zip(metas, params, strict=True)
    )
    assert src.held_names() is None
    pairs = list(checked_iter(src, metas, describe_tensor))
    for (name, t), (pname, p) in zip(pairs, params, strict=True):
        assert name == pname and torch.equal(t, p) and not t.requires_grad
    assert len(layerwise_groups(metas)) == 4  # embed, layer 0, layer 1, (norm, lm_head)
    assert [len(b) for b in src.iter_groups()] == [len(g) for g in layerwise_groups(metas)]


def test_fresh_pass_each_iteration_sees_updates():
    model = torch.nn.Linear(2, 2)
    src = ModuleSource(model)
    first = dict(src)["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1)
    assert torch.equal(dict(src)["weight"], first + 1)


def test_dtype_cast_applies_to_floating_tensors_only():
    model = WithBuffers()
    src = ModuleSource(model, dtype=torch.bfloat16, include_buffers=True)
    metas = {m.name: m for m in src.metadata()}
    assert metas["head.weight"].dtype == "bfloat16"
    assert metas["layers.0.num_batches_tracked"].dtype == "int64"
    got = dict(src)
    assert got["head.weight"].dtype == torch.bfloat16
    assert torch.equal(got["head.weight"], model.head.weight.detach().to(torch.bfloat16))
    list(checked_iter(src, src.metadata(), describe_tensor))
    # ConfigError (a ValueError), as every refusal of the user's input (was a bare ValueError)
    with pytest.raises(ConfigError, match="floating-point"):
        ModuleSource(model, dtype=torch.int32)
    with pytest.raises(ConfigError, match="cannot cross the wire"):
        ModuleSource(model, dtype=torch.complex64)


def test_persistent_buffers_optional_and_adjacent_to_their_layer():
    model = WithBuffers()
    assert [m.name for m in ModuleSource(model).metadata()] == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "head.weight",
        "head.bias",
    ]
    names = [m.name for m in ModuleSource(model, include_buffers=True).metadata()]
    assert names[:5] == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.0.running_mean",
        "layers.0.running_var",
        "layers.0.num_batches_tracked",
    ]
    assert "scratch" not in names  # non-persistent: not in a checkpoint
    assert names == list(model.state_dict())
    layerwise_groups(ModuleSource(model, include_buffers=True).metadata())  # contiguous layers


def test_tied_weights_sent_once_by_default_or_under_every_name():
    model = tiny_llama(seed=0, tied=True)
    default = [m.name for m in ModuleSource(model).metadata()]
    assert "lm_head.weight" not in default and "model.embed_tokens.weight" in default
    every = dict(ModuleSource(model, keep_tied=True))
    assert torch.equal(every["lm_head.weight"], every["model.embed_tokens.weight"])
    assert len(every) == len(default) + 1


def test_checked_iter_catches_a_source_that_changed_under_it():
    model = torch.nn.Linear(2, 2)
    src = ModuleSource(model)
    metas = src.metadata()
    model.weight = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(
        SourceMismatch, match=r"declared 'weight' float32 \[2, 2\], got 'weight' float32 \[3, 2\]"
    ):
        list(checked_iter(src, metas, describe_tensor))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ModuleSource({"weight": torch.zeros(1)})  # type: ignore[arg-type]


class Shared(torch.nn.Module):
    """One submodule reachable twice, a None child, and nesting several levels deep."""

    def __init__(self) -> None:
        super().__init__()
        inner = torch.nn.Linear(2, 2)
        self.a = torch.nn.Sequential(inner, torch.nn.Sequential(torch.nn.Linear(2, 3), inner))
        self.b = inner
        self.gone = None
        self.c = torch.nn.ModuleDict(
            {"x": torch.nn.LayerNorm(2), "y": torch.nn.Sequential(torch.nn.Linear(3, 1))}
        )


class OwnWalk(torch.nn.Linear):
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):  # type: ignore[override]
        yield prefix, self  # hides its children, as a user wrapper might


@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_module_walk_is_torchs_named_modules(remove_duplicate: bool) -> None:
    from weightwire.torch_side.sender.source import _named_modules

    for model in (
        Shared(),
        tiny_llama(seed=0, tied=True),
        torch.nn.Sequential(OwnWalk(2, 2), torch.nn.Linear(2, 2)),
    ):
        got = _named_modules(model, remove_duplicate=remove_duplicate)
        want = list(model.named_modules(remove_duplicate=remove_duplicate))
        assert [(n, id(m)) for n, m in got] == [(n, id(m)) for n, m in want]
    names = [m.name for m in ModuleSource(Shared(), keep_tied=True).metadata()]
    assert names.count("a.0.weight") == 1 and "a.1.1.weight" in names and "b.weight" in names


def test_metadata_is_reused_while_nothing_changed_and_rebuilt_when_something_did() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    src = ModuleSource(model)
    first = src.metadata()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # new values, same declaration
    again = src.metadata()
    assert (
        again == first
        and again is not first
        and all(a is b for a, b in zip(again, first, strict=True))
    )
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 3))  # a new shape
    assert [m.shape for m in src.metadata()][0] == (4, 3)
    model[1].weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))  # a new dtype
    assert src.metadata()[2].dtype == "float16"
    model[0].bias = None  # a tensor gone
    assert [m.name for m in src.metadata()] == ["0.weight", "1.weight", "1.bias"]
    model[1].weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="cannot cross the wire"):
        src.metadata()  # an unsupported dtype is still refused on every declaration
