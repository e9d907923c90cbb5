"""Real raises land in the exception tree where callers look: a bad init info is a
``ConfigError`` and a ``ValueError`` naming the field, an unanswered control call a
``WeightSyncError`` and a ``TimeoutError``, control-plane errors survive pickle and copy, a
missing extra is an ``ImportError``. (The tree itself: ``test_errors.py``.)"""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import Future

import pytest

from weightwire.shared.errors import (
    ConfigError,
    ControlTimeout,
    SourceMismatch,
    WeightSyncError,
    WeightwireError,
)


def test_a_bad_init_info_is_a_value_error_and_a_weightwire_error_naming_the_field() -> None:
    from weightwire.backends.tcp.info import TCPInitInfo

    good = {
        "host": "127.0.0.1",
        "port": 40000,
        "secret_b64": "A" * 172 + "==",
        "rank_offset": 1,
        "world_size": 2,
    }
    with pytest.raises(ValueError, match=r"\.port must be in \[1, 65535\], got 0") as caught:
        TCPInitInfo.from_dict({**good, "port": 0})
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, WeightwireError)
    with pytest.raises(ConfigError, match="unknown keys.*'prot'"):
        TCPInitInfo.from_dict({**good, "prot": 1})


def test_a_bad_trainer_init_info_is_a_config_error_naming_the_field() -> None:
    from weightwire.trainer.config import TrainerInitInfo

    with pytest.raises(ConfigError, match="packed_num_buffers must be an int") as caught:
        TrainerInitInfo(backend="weightwire_tcp", packed_num_buffers=0)
    assert isinstance(caught.value, ValueError)


def test_a_source_that_disagrees_with_its_metadata_raises_a_config_error() -> None:
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.source import checked_iter

    metas = [ParamMeta("w", "float32", (2,))]
    pairs = checked_iter([("w", None), ("extra", None)], metas, lambda _t: ("float32", (2,)))
    with pytest.raises(SourceMismatch, match="first extra is 'extra'") as caught:
        list(pairs)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)


def test_a_stock_refusal_is_a_config_error() -> None:
    from weightwire.backends.nccl.stock import StockRefusal, plan_for_stock
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.version import ServerFeatures

    metas = [ParamMeta("mask", "bool", (4,))]
    with pytest.raises(StockRefusal, match="'mask'") as caught:
        plan_for_stock(
            metas,
            features=ServerFeatures.for_version("0.33.0"),
            packed=False,
            buffer_size_bytes=1 << 20,
        )
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)


def test_an_unanswered_control_call_is_a_weight_sync_error_and_a_timeout() -> None:
    from weightwire.trainer.transfer import await_call as _await

    with pytest.raises(
        WeightSyncError,
        match=r"^update_weights \(after the last broadcast\) did not return "
        r"within 0.01 s$",
    ) as caught:
        _await(Future(), 0.01, "update_weights (after the last broadcast)")
    exc = caught.value
    assert isinstance(exc, ControlTimeout) and isinstance(exc, TimeoutError)
    assert (exc.route, exc.status) == ("update_weights", None)


def test_control_plane_errors_survive_pickle_and_copy() -> None:
    refused = WeightSyncError("update_weights", 409, "busy", "http://a")
    timeout = ControlTimeout(
        "init did not return within 1 s", route="init_weight_transfer_engine", server="http://b"
    )
    for exc in (refused, timeout):
        for clone in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
            assert type(clone) is type(exc) and str(clone) == str(exc)
            assert (clone.route, clone.status, clone.message, clone.server) == (
                exc.route,
                exc.status,
                exc.message,
                exc.server,
            )


def test_a_missing_extra_is_an_import_error_and_a_weightwire_error() -> None:
    from weightwire._extras import MissingExtra, require

    with pytest.raises(
        ImportError, match="this test needs 'not_installed_xyz': .*pip install not_installed_xyz"
    ) as caught:
        require("not_installed_xyz", purpose="this test")
    assert isinstance(caught.value, MissingExtra) and isinstance(caught.value, WeightwireError)
    assert caught.value.name == "not_installed_xyz"
    assert str(MissingExtra("flax")).endswith('[jax]"')


# -- the public calls that raised bare builtins: now the tree's classes, naming the input ------


def test_a_bad_param_meta_is_a_config_error_naming_the_field() -> None:
    from weightwire.shared.meta import ParamMeta

    with pytest.raises(ConfigError, match=r"ParamMeta\.name must be a non-empty string, got ''"):
        ParamMeta("", "float32", (2,))
    with pytest.raises(ConfigError, match=r"dtype of 'w': unsupported dtype 'float7'") as caught:
        ParamMeta("w", "float7", (2,))
    assert isinstance(caught.value, ValueError)  # a handler for the builtin still catches it
    with pytest.raises(ConfigError, match=r"ParamMeta: unknown keys \['extra'\]; allowed"):
        ParamMeta.from_dict({"name": "w", "dtype": "float32", "shape": [2], "extra": 1})


def test_an_unknown_backend_is_a_config_error_listing_the_known_ones() -> None:
    from weightwire import backends

    with pytest.raises(ConfigError, match=r"unknown backend 'tpc'; known: .*weightwire_tcp"):
        backends.get_backend("tpc")
    with pytest.raises(ConfigError, match=r"unknown backend 'tpc'; known: .*weightwire_tcp"):
        backends.get("tpc")


def test_a_server_version_that_does_not_parse_is_a_config_error_naming_it() -> None:
    from weightwire.shared.version import parse_version

    with pytest.raises(ConfigError, match=r"cannot parse server version 'v-next'"):
        parse_version("v-next")


def test_a_bad_fp8_scheme_is_a_config_error_naming_its_field() -> None:
    from weightwire.shared.quant import scheme_from_dict

    with pytest.raises(ConfigError, match=r"fp8\.kind must be 'block' or 'tensor', got 'row'"):
        scheme_from_dict({"kind": "row"}, "fp8")


def test_layers_out_of_order_are_a_config_error_naming_the_tensor() -> None:
    from weightwire.shared.groups import layerwise_groups
    from weightwire.shared.meta import ParamMeta

    metas = [
        ParamMeta(f"model.layers.{i}.{n}.weight", "float32", (2,))
        for i, n in ((0, "q"), (1, "q"), (0, "k"))
    ]
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.k\.weight' belongs to .*reorder"):
        layerwise_groups(metas)


def test_a_torch_group_before_its_process_group_is_not_initialized_and_a_runtime_error() -> None:
    from weightwire.shared.errors import NotInitialized
    from weightwire.torch_side.sender.group import TorchStoreGroup

    with pytest.raises(NotInitialized, match=r"torch\.distributed\.init_process_group first"):
        TorchStoreGroup()
    assert issubclass(NotInitialized, ConfigError) and issubclass(NotInitialized, RuntimeError)
    with pytest.raises(ConfigError, match=r"rank 3 is not in a group of size 2"):
        TorchStoreGroup(object(), rank=3, size=2)


def test_a_jax_group_before_jax_distributed_is_not_initialized() -> None:
    from weightwire.jax_side.multiprocess import JaxProcessGroup
    from weightwire.shared.errors import NotInitialized

    with pytest.raises(NotInitialized, match=r"jax\.distributed\.initialize\(\) first"):
        JaxProcessGroup()


def test_a_merge_axes_the_wrong_way_round_is_a_naming_error() -> None:
    import jax.numpy as jnp

    from weightwire.jax_side.transforms import MergeAxes, NamingError

    with pytest.raises(NamingError, match=r"MergeAxes\(2, 0\) on rank 3: last axis precedes"):
        MergeAxes(2, 0)(jnp.zeros((2, 3, 4)))


def test_an_unknown_layout_family_is_a_config_error_listing_the_known_ones() -> None:
    from weightwire.jax_side.layouts import preset_layout

    with pytest.raises(ConfigError, match=r"no layout for family 'gpt5'; known: .*llama"):
        preset_layout("gpt5", {})


def test_the_command_lines_bad_arguments_are_config_errors_naming_them() -> None:
    from weightwire.tools.demo.config import DemoConfig
    from weightwire.tools.server.tiny import resolve_model

    with pytest.raises(ConfigError, match=r"--backend must be one of .*got 'carrier-pigeon'"):
        DemoConfig(backend="carrier-pigeon")
    with pytest.raises(ConfigError, match=r"--model 'no-such-model' is neither tiny-llama"):
        resolve_model("no-such-model")


def test_a_tcp_listener_nobody_can_dial_is_a_config_error_naming_the_fix() -> None:
    from weightwire.backends.tcp.rendezvous import TCPRendezvous

    with pytest.raises(ConfigError, match=r"bind_host '0\.0\.0\.0' .* pass advertise_host"):
        TCPRendezvous(world_size=2, bind_host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"world_size must be an int in \[2, \d+\], got 1"):
        TCPRendezvous(world_size=1)


def test_a_bad_ipc_wait_mode_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightwire.backends.ipc.slots import wait_mode

    monkeypatch.setenv("WEIGHTWIRE_IPC_WAIT", "spin")
    with pytest.raises(ConfigError, match=r"WEIGHTWIRE_IPC_WAIT must be 'device' or 'host'"):
        wait_mode()
