"""DeepSpeed's checkpoint pickles load as inert stand-ins; any other global is refused before unpickling.

DeepSpeed is not installed here (and is never imported): the files are built by pickling throwaway
look-alikes of its classes under DeepSpeed's module names, set up the way DeepSpeed 0.19.8's
`__init__`s set them (runtime/fp16/loss_scaler.py, runtime/zero/config.py, utils/tensor_fragment.py),
in dicts shaped as its `state_dict`s. Real DeepSpeed files, when tests/fixtures/deepspeed_checkpoints
has them, are loaded too.
"""

from __future__ import annotations

import argparse
import builtins
import os
import subprocess
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import pytest
import torch

from zerotrain.checkpoint.deepspeed_pickle import (
    DEEPSPEED_STAND_INS,
    ForeignPickleError,
    PickledDynamicLossScaler,
    PickledFragmentAddress,
    PickledLossScaler,
    PickledZeroStage,
    as_plain_data,
    load_deepspeed_file,
)
from zerotrain.checkpoint.errors import CheckpointError

REAL_FILES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"


class LossScaler:
    def __init__(self, scale=1):
        self.cur_scale = scale
        self.dynamic = False


class DynamicLossScaler:
    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, dtype=torch.half):
        self.cur_scale = init_scale
        self.dynamic = False
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = True
        self.dynamic = True
        self.dtype = dtype


class ZeroStageEnum(int, Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class fragment_address:  # noqa: N801 - DeepSpeed's own spelling
    numel: int
    start: int


class DeepSpeedZeroConfig:  # a DeepSpeed class no checkpoint of DeepSpeed's holds
    def __init__(self):
        self.stage = 3


DEEPSPEED_HOMES = {
    "deepspeed.runtime.fp16.loss_scaler": (LossScaler, DynamicLossScaler),
    "deepspeed.runtime.zero.config": (ZeroStageEnum, DeepSpeedZeroConfig),
    "deepspeed.utils.tensor_fragment": (fragment_address,),
}
for _home, _classes in DEEPSPEED_HOMES.items():
    for _cls in _classes:
        _cls.__module__ = _home


@contextmanager
def deepspeed_names_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The look-alikes can be found under DeepSpeed's module names inside, and are gone afterwards."""
    with monkeypatch.context() as patch:
        for home, classes in DEEPSPEED_HOMES.items():
            parts = home.split(".")
            for depth in range(1, len(parts) + 1):
                name = ".".join(parts[:depth])
                if name not in sys.modules:
                    patch.setitem(sys.modules, name, types.ModuleType(name))
            for cls in classes:
                patch.setattr(sys.modules[home], cls.__qualname__, cls, raising=False)
        yield
    assert "deepspeed" not in sys.modules


def save_as_deepspeed(obj, path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torch.save `obj` as DeepSpeed would, its look-alikes pickled under DeepSpeed's names."""
    with deepspeed_names_importable(monkeypatch):
        torch.save(obj, path)
    return path


def _zero2_fp16_optim_states() -> dict:
    scaler = DynamicLossScaler(
        init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 7, 3, 1
    return {
        "optimizer_state_dict": {
            "loss_scaler": scaler,
            "dynamic_loss_scale": True,
            "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(5)}},
                                     "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
            "single_partition_of_fp32_groups": [torch.arange(5.0)],
            "zero_stage": ZeroStageEnum.gradients,
            "group_paddings": [1],
            "partition_count": [2],
            "ds_version": "0.19.8",
            "param_slice_mappings": [OrderedDict([("w", fragment_address(numel=3, start=0)),
                                                  ("b", fragment_address(numel=2, start=3))])],
        },
        "ds_config": {"train_batch_size": 4, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2}},
        "ds_version": "0.19.8",
    }


def test_zero2_fp16_optimizer_states_load_as_stand_ins(tmp_path, monkeypatch):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    save_as_deepspeed(_zero2_fp16_optim_states(), path, monkeypatch)
    state = load_deepspeed_file(path)["optimizer_state_dict"]
    scaler = state["loss_scaler"]
    assert type(scaler) is PickledDynamicLossScaler
    assert (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.scale_factor) == (65536.0, 7, 3, 2.0)
    assert (scaler.scale_window, scaler.min_scale, scaler.delayed_shift, scaler.cur_hysteresis) == (1000, 1, 2, 1)
    assert (scaler.consecutive_hysteresis, scaler.dynamic, scaler.dtype) == (False, True, torch.float16)
    assert state["zero_stage"] is PickledZeroStage.gradients and state["zero_stage"] == 2
    mapping = OrderedDict(w=PickledFragmentAddress(3, 0), b=PickledFragmentAddress(2, 3))
    assert state["param_slice_mappings"] == [mapping]
    assert torch.equal(state["single_partition_of_fp32_groups"][0], torch.arange(5.0))
    assert state["base_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert "deepspeed" not in sys.modules


def test_zero3_static_scaler_shapes_and_client_args_load(tmp_path, monkeypatch):
    optim = {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
                                      "partition_count": 2, "fp32_flat_groups": [torch.zeros(4)]}}
    model = {"module": {"w": torch.empty(0)}, "param_shapes": [OrderedDict(w=torch.Size([2, 3]))],
             "global_steps": 5, "args": argparse.Namespace(lr=0.1, seed=3)}
    optim_path = save_as_deepspeed(optim, tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", monkeypatch)
    model_path = save_as_deepspeed(model, tmp_path / "zero_pp_rank_1_mp_rank_00_model_states.pt", monkeypatch)
    state = load_deepspeed_file(optim_path)["optimizer_state_dict"]
    assert state["zero_stage"] is PickledZeroStage.weights
    assert type(state["loss_scaler"]) is PickledLossScaler
    assert (state["loss_scaler"].cur_scale, state["loss_scaler"].dynamic) == (1.0, False)
    model_state = load_deepspeed_file(model_path)
    assert model_state["param_shapes"][0]["w"] == torch.Size([2, 3])
    assert vars(model_state["args"]) == {"lr": 0.1, "seed": 3}


def test_plain_data_has_the_scaler_fields_stage_ints_and_fragment_dicts(tmp_path, monkeypatch):
    path = save_as_deepspeed(_zero2_fp16_optim_states(), tmp_path / "optim.pt", monkeypatch)
    plain = as_plain_data(load_deepspeed_file(path))["optimizer_state_dict"]
    assert plain["loss_scaler"] == {
        "dynamic": True, "cur_scale": 65536.0, "cur_iter": 7, "last_overflow_iter": 3, "scale_factor": 2.0,
        "scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 1,
        "consecutive_hysteresis": False, "raise_error_at_min_scale": True, "dtype": torch.float16,
    }
    assert type(plain["zero_stage"]) is int and plain["zero_stage"] == 2
    mapping = plain["param_slice_mappings"][0]
    assert type(mapping) is OrderedDict and mapping == {"w": {"numel": 3, "start": 0}, "b": {"numel": 2, "start": 3}}
    static = as_plain_data({"s": PickledLossScaler(), "args": argparse.Namespace(lr=0.5), "shape": torch.Size([2])})
    assert static == {"s": {"dynamic": False, "cur_scale": 1.0}, "args": {"lr": 0.5}, "shape": torch.Size([2])}
    assert type(static["shape"]) is torch.Size


class Payload:
    """Runs `func(*args)` when unpickled by a trusting loader."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


PAYLOADS = {  # the global as the pickle names it (protocol 2 writes Python 2's module names) -> payload
    f"{os.system.__module__}.system": lambda marker: Payload(os.system, (f"touch {marker}",)),
    "builtins.eval": lambda marker: Payload(builtins.eval, (f"__import__('pathlib').Path({str(marker)!r}).touch()",)),
    "commands.Popen": lambda marker: Payload(subprocess.Popen, (["touch", str(marker)],)),
}


@pytest.mark.parametrize("global_name", sorted(PAYLOADS))
def test_planted_reduce_payload_is_refused_naming_file_and_global_and_never_runs(tmp_path, monkeypatch, global_name):
    marker = tmp_path / "payload-ran"
    state = _zero2_fp16_optim_states()
    state["client_state"] = {"hook": PAYLOADS[global_name](marker)}
    path = save_as_deepspeed(state, tmp_path / "mp_rank_00_model_states.pt", monkeypatch)
    with pytest.raises(ForeignPickleError) as refused:
        load_deepspeed_file(path)
    assert str(path) in str(refused.value) and global_name in str(refused.value)
    assert refused.value.names == [global_name]
    assert not marker.exists()
    # The control: the same file does run its payload when unpickled without an allow-list.
    with deepspeed_names_importable(monkeypatch):
        ran = torch.load(path, weights_only=False)["client_state"]["hook"]
    if isinstance(ran, subprocess.Popen):
        ran.wait()
    assert marker.exists()


def test_unknown_deepspeed_class_is_refused_naming_it(tmp_path, monkeypatch):
    state = _zero2_fp16_optim_states()
    state["zero_config"] = DeepSpeedZeroConfig()
    path = save_as_deepspeed(state, tmp_path / "mp_rank_00_model_states.pt", monkeypatch)
    with pytest.raises(ForeignPickleError) as refused:
        load_deepspeed_file(path)
    message = str(refused.value)
    assert str(path) in message and "deepspeed.runtime.zero.config.DeepSpeedZeroConfig" in message
    assert "DeepSpeed class outside that list" in message and "zero_to_fp32.py" in message


def test_allowed_name_called_with_arguments_is_refused(tmp_path, monkeypatch):
    """A stand-in is never a callable a pickle can feed arguments to: REDUCE on it fails, nothing runs."""
    path = save_as_deepspeed({"loss_scaler": Payload(LossScaler, ("rm -rf /",))}, tmp_path / "optim.pt", monkeypatch)
    with pytest.raises(CheckpointError, match="cannot read .*optim.pt"):
        load_deepspeed_file(path)


def test_allow_list_is_left_as_it_was_after_loads(tmp_path, monkeypatch):
    good = save_as_deepspeed(_zero2_fp16_optim_states(), tmp_path / "good.pt", monkeypatch)
    bad = save_as_deepspeed({"hook": Payload(builtins.eval, ("1",))}, tmp_path / "bad.pt", monkeypatch)
    with torch.serialization.safe_globals([argparse.Namespace]):  # a user's own entry, which must survive
        before = set(torch.serialization.get_safe_globals())
        load_deepspeed_file(good)
        with pytest.raises(ForeignPickleError):
            load_deepspeed_file(bad)
        after = set(torch.serialization.get_safe_globals())
    assert after == before and argparse.Namespace in after
    assert not [entry for entry in after if isinstance(entry, tuple) and entry[1] in DEEPSPEED_STAND_INS]


def test_missing_file_and_non_dict_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="missing DeepSpeed checkpoint file .*absent.pt"):
        load_deepspeed_file(tmp_path / "absent.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="list.pt: it holds a list"):
        load_deepspeed_file(tmp_path / "list.pt")
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="cannot read .*cut.pt"):
        load_deepspeed_file(tmp_path / "cut.pt")


_REAL = sorted(REAL_FILES.rglob("*.pt")) if REAL_FILES.is_dir() else []


@pytest.mark.parametrize("path", _REAL or [None], ids=[str(p.relative_to(REAL_FILES)) for p in _REAL] or ["none"])
def test_every_real_deepspeed_fixture_loads(path):
    if path is None:
        pytest.skip(f"no DeepSpeed-written fixtures under {REAL_FILES}")
    loaded = load_deepspeed_file(path, bare_tensor="zero" in path.parts)  # universal per-parameter files
    assert loaded is not None and "deepspeed" not in sys.modules
    as_plain_data(loaded)
