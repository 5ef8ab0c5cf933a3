"""DeepSpeed's checkpoint files, read without DeepSpeed and without running anything they hold.

DeepSpeed's `.pt` files (`mp_rank_00_model_states.pt`, `zero_pp_rank_R_mp_rank_00_model_states.pt`,
`[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`, the universal `zero/optimizer_state.pt` and
`zero/<param>/*.pt`) are
torch.save pickles that hold a few DeepSpeed objects besides tensors and plain data. Listed from
DeepSpeed 0.19.8's `save_checkpoint` path (engine `_save_checkpoint`/`_save_zero_checkpoint`, the ZeRO
1-2 and 3, bf16 and fp16 optimizers' `state_dict`), the only classes it pickles are:

- `deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler` (`optimizer_state_dict
  ["loss_scaler"]`, ZeRO 1-3; an attribute bag, pickled as its `__dict__`);
- `deepspeed.runtime.zero.config.ZeroStageEnum` (`["zero_stage"]`, an int enum);
- `deepspeed.utils.tensor_fragment.fragment_address` (`["param_slice_mappings"]`, ZeRO 1-2 and bf16;
  a dataclass of numel and start).

Everything else there is tensors, `torch.Size`, dtypes, OrderedDicts and plain data (`ds_config` is
the config dict, schedulers' `state_dict()`s are plain; the files `ds_to_universal.py` writes
hold a subset of these). Scripts add `argparse.Namespace` through
`client_state` (Megatron-style `args`), an attribute bag too. `load_deepspeed_file` maps exactly those
names to inert stand-ins defined here and loads with `torch.load(weights_only=True)`; any other
global is refused, naming the file and the global, before the file is unpickled.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from zerotrain.checkpoint.errors import CheckpointError


class PickledLossScaler:
    """Stand-in for DeepSpeed's static `LossScaler`: the pickled fields as attributes, no behaviour."""

    dynamic: bool = False
    cur_scale: float = 1.0


class PickledDynamicLossScaler(PickledLossScaler):
    """Stand-in for DeepSpeed's `DynamicLossScaler`; defaults only cover fields older releases lacked."""

    dynamic: bool = True
    cur_iter: int = 0
    last_overflow_iter: int = -1
    scale_factor: float = 2.0
    scale_window: int | None = None
    min_scale: float | None = None
    delayed_shift: int = 1
    cur_hysteresis: int = 1
    consecutive_hysteresis: bool = False
    raise_error_at_min_scale: bool = True


class PickledZeroStage(int, Enum):
    """Stand-in for DeepSpeed's `ZeroStageEnum` (same names and values; pickled as `ZeroStageEnum(value)`)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights`, as in DeepSpeed


@dataclass
class PickledFragmentAddress:
    """Stand-in for DeepSpeed's `fragment_address`: where a parameter lies in a rank's flat fp32 partition."""

    numel: int
    start: int


DEEPSPEED_STAND_INS: dict[str, type] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": PickledLossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": PickledDynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": PickledZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": PickledFragmentAddress,
    # An attribute bag whose unpickling sets attributes only; scripts save their args in client_state.
    "argparse.Namespace": argparse.Namespace,
}
"""The pickled name of every non-torch class a DeepSpeed checkpoint may hold, and what it loads as."""


class ForeignPickleError(CheckpointError):
    """A DeepSpeed checkpoint file holds globals outside the allow-list; nothing of it was unpickled."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path, self.names = Path(path), sorted(names)
        super().__init__(_foreign_globals_message(self.path, self.names))


def load_deepspeed_file(path: str | Path, bare_tensor: bool = False) -> dict | torch.Tensor:
    """Load one DeepSpeed checkpoint file onto the CPU, its DeepSpeed objects as the stand-ins above.

    `bare_tensor`: a tensor alone is accepted too (universal checkpoints' per-parameter files at
    stage 3, and every `step.pt`).

    Raises ForeignPickleError if the pickle names any global that is neither torch's weights-only
    set nor `DEEPSPEED_STAND_INS` (checked before unpickling), CheckpointError if the file is
    missing, unreadable, or does not hold a dict (or the tensor allowed). DeepSpeed is never imported.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing DeepSpeed checkpoint file {path}: check the folder and tag")
    with _stand_ins_allowed():
        foreign = _foreign_globals(path)
        if foreign:
            raise ForeignPickleError(path, foreign)
        try:
            # weights_only: torch's restricted unpickler refuses anything outside the allow-list again
            # (also what a static scan cannot see): only the stand-ins and torch's own types are built.
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            detail = _torch_reason(error)
            raise CheckpointError(
                f"cannot read {path}: it is truncated, corrupt, or holds objects zerotrain will not unpickle "
                f"({detail:.300}); copy the file again from where the DeepSpeed run wrote it"
            ) from error
    if not isinstance(loaded, dict) and not (bare_tensor and torch.is_tensor(loaded)):
        raise CheckpointError(
            f"cannot read {path}: it holds a {type(loaded).__name__}, not the dict DeepSpeed saves; "
            "is it a DeepSpeed checkpoint file?"
        )
    return loaded


def loss_scaler_state(scaler: PickledLossScaler) -> dict[str, Any]:
    """A loaded loss scaler's fields as a dict: `dynamic`, `cur_scale` and, when dynamic, the rest.

    DeepSpeed's scalers have no `state_dict`: their state is these attributes (the fp16 optimizers'
    own `state_dict` copies `cur_scale`, `cur_iter`, `last_overflow_iter`, `scale_factor`,
    `scale_window` out of them under the same names).
    """
    fields = {"dynamic": scaler.dynamic, "cur_scale": scaler.cur_scale}
    if scaler.dynamic:
        for name in PickledDynamicLossScaler.__annotations__:
            fields[name] = getattr(scaler, name)
    fields.update(vars(scaler))  # what the file holds wins over the defaults (dtype included)
    return fields


def as_plain_data(value: Any) -> Any:
    """`value` with every stand-in turned into plain data, for the rest of zerotrain to read.

    Loss scalers become `loss_scaler_state` dicts, ZeRO stages ints, fragment addresses
    `{"numel", "start"}` dicts, a Namespace the dict of its attributes; containers are rebuilt
    (dict and OrderedDict keep their type), tensors and everything else are returned as they are.
    """
    if isinstance(value, PickledLossScaler):
        return loss_scaler_state(value)
    if isinstance(value, PickledZeroStage):
        return int(value)
    if isinstance(value, PickledFragmentAddress):
        return {"numel": value.numel, "start": value.start}
    if isinstance(value, argparse.Namespace):
        return {k: as_plain_data(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return type(value)((k, as_plain_data(v)) for k, v in value.items())
    if type(value) in (list, tuple):  # not torch.Size: a tuple subclass that stays as it is
        return type(value)(as_plain_data(v) for v in value)
    return value


# --------------------------------------------------------------------------- #
# internals

_ALLOW_LIST = [(stand_in, name) for name, stand_in in DEEPSPEED_STAND_INS.items()]
# (stand-in, name) pairs: entries of a user's own `add_safe_globals` are other entries, never removed here.
_allowing = torch.serialization.safe_globals(_ALLOW_LIST)
_allow_lock = threading.Lock()
_allow_depth = 0


@contextmanager
def _stand_ins_allowed() -> Iterator[None]:
    """torch's allow-list holds the stand-ins while any thread loads a DeepSpeed file.

    torch keeps one process-wide list and `safe_globals` removes its entries on exit, so loads in
    two threads would strip each other's: the entries go in with the first load and out with the last.
    """
    global _allow_depth
    with _allow_lock:
        if _allow_depth == 0:
            _allowing.__enter__()
        _allow_depth += 1
    try:
        yield
    finally:
        with _allow_lock:
            _allow_depth -= 1
            if _allow_depth == 0:
                _allowing.__exit__(None, None, None)


def _foreign_globals(path: Path) -> list[str]:
    """The globals the pickle names outside torch's weights-only set and the stand-ins (a static scan).

    A file the scan cannot read (not torch's zip format, corrupt, or using opcodes torch's safe
    unpickler lacks) gives []: the weights-only load that follows refuses it with torch's reason.
    """
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:
        return []


def _torch_reason(error: Exception) -> str:
    """The line of torch's load error that says what failed (its weights-only text is mostly advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    return (reason or lines or [type(error).__name__])[0]


def _foreign_globals_message(path: Path, names: list[str]) -> str:
    known = ", ".join(sorted(DEEPSPEED_STAND_INS))
    deepspeed_names = [n for n in names if n.split(".")[0] == "deepspeed"]
    other_names = [n for n in names if n not in deepspeed_names]
    lines = [
        f"{path} names {', '.join(names)} in its pickle, which zerotrain will not load: it reads DeepSpeed "
        f"checkpoints with torch.load(weights_only=True) and an allow-list of the classes DeepSpeed checkpoints "
        f"hold ({known}). Nothing in the file was unpickled or run."
    ]
    if deepspeed_names:
        lines.append(
            f"{', '.join(deepspeed_names)}: a DeepSpeed class outside that list, so the checkpoint comes from "
            "a DeepSpeed feature or release zerotrain cannot read. Start from its weights instead (DeepSpeed's "
            "zero_to_fp32.py in the checkpoint folder), or open a zerotrain issue naming the class."
        )
    if other_names:
        lines.append(
            f"{', '.join(other_names)}: not DeepSpeed's. If you wrote this file and it is your own class "
            "saved through client_state, re-save that entry as plain data (dicts, lists, numbers, strings, "
            "tensors), or register the class with torch.serialization.add_safe_globals before loading. If you "
            "did not write this file, do not load it: unpickling it could run code."
        )
    return "\n".join(lines)
