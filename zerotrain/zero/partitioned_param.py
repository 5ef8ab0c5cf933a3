"""PartitionedParameter: a ZeRO-3 parameter that says what it is between uses.

At stage 3 a rank keeps only its shard of each bucket; between uses every
parameter of the bucket is an empty tensor whose full shape is `param.ds_shape`.
A plain `nn.Parameter` would print as `tensor([])`, shape `(0,)`, which looks like
a bug. `FlatParam.keep_only_shard` therefore turns each such parameter into this
subclass: it computes exactly as an `nn.Parameter` (it adds no
`__torch_function__`, so torch sees the same tensor), and only its presentation
and copying differ:

    >>> print(model.lm_head.weight)          # between uses
    PartitionedParameter(ds_shape=(64, 32), dtype=torch.bfloat16, requires_grad=True, ds_status='partitioned')
      ZeRO-3 keeps its values sharded across 2 ranks; this tensor is empty until gathered.
      To read or change it: with zerotrain.zero.GatheredParameters([param]): ...

Inside `GatheredParameters` (or a unit's forward and backward) it prints as any
`nn.Parameter`. DeepSpeed's attributes are there: `ds_id` (unique per parameter),
`ds_shape`, `ds_numel` and `ds_status`, a `ZeroParamStatus` as in DeepSpeed: AVAILABLE while
whole, INFLIGHT while a prefetch gathers it, NOT_AVAILABLE otherwise. Scripts written for
DeepSpeed test exactly these (`hasattr(p, "ds_id")`, `p.ds_status == ZeroParamStatus.NOT_AVAILABLE`)
to decide whether to gather before reading a parameter.
"""

from __future__ import annotations

import enum
import itertools

import torch
from torch import nn

_HOW_TO_READ = "with zerotrain.zero.GatheredParameters([param]): ..."
_next_ds_id = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names and values for where a ZeRO-3 parameter's values are."""

    AVAILABLE = 1  # whole in this tensor
    NOT_AVAILABLE = 2  # sharded: this tensor is empty
    INFLIGHT = 3  # being gathered (a prefetch)


class PartitionedParameter(nn.Parameter):
    """An `nn.Parameter` of a ZeRO-3 bucket: whole while gathered, an empty placeholder otherwise.

    `isinstance(p, nn.Parameter)` holds, autograd and optimizers treat it as a
    Parameter, and `Module.state_dict()` holds plain tensors (empty while
    partitioned: gather first). `copy.deepcopy` gives a plain, independent
    `nn.Parameter` with the values while gathered; while partitioned the copy
    holds no values (a deep copy cannot gather: that is a collective).
    """

    @property
    def ds_status(self) -> ZeroParamStatus:
        """Where the values are: AVAILABLE (this tensor holds them whole), INFLIGHT, NOT_AVAILABLE."""
        ds_numel = getattr(self, "ds_numel", None)
        if not ds_numel or self.numel() == ds_numel:
            return ZeroParamStatus.AVAILABLE
        bucket = getattr(self, "_zerotrain_flat_param", None)
        if bucket is not None and bucket._pending_gather is not None:
            return ZeroParamStatus.INFLIGHT
        return ZeroParamStatus.NOT_AVAILABLE

    def __repr__(self) -> str:
        if self.ds_status is ZeroParamStatus.AVAILABLE:
            # A Parameter aliasing the same memory prints exactly as torch prints parameters.
            return repr(nn.Parameter(self.data, self.requires_grad))
        shape = tuple(getattr(self, "ds_shape", ()))
        head = (
            f"PartitionedParameter(ds_shape={shape}, dtype={self.dtype}, "
            + (f"device={self.device}, " if self.device.type != "cpu" else "")
            + f"requires_grad={self.requires_grad}, ds_status='partitioned')"
        )
        bucket = getattr(self, "_zerotrain_flat_param", None)
        if bucket is None:
            return (
                f"{head}\n  A copy made while the parameter was partitioned: it holds no values.\n"
                f"  Deep-copy the original inside `{_HOW_TO_READ}` to copy its values."
            )
        ranks = bucket.padded_numel // bucket.shard_size
        return (
            f"{head}\n  ZeRO-3 keeps its values sharded across {ranks} rank{'s' if ranks != 1 else ''}; "
            "this tensor is empty until gathered.\n"
            f"  To read or change it: {_HOW_TO_READ}"
        )

    __str__ = __repr__

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        if self.ds_status is ZeroParamStatus.AVAILABLE:
            # A whole, independent parameter: what a copy of a model's weights is for.
            result = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        else:
            result = PartitionedParameter(torch.empty(0, dtype=self.dtype, device=self.device), self.requires_grad)
            result.ds_shape = self.ds_shape
            result.ds_numel = self.ds_numel
        memo[id(self)] = result
        return result


def mark_partitioned(param: nn.Parameter) -> None:
    """Makes a plain `nn.Parameter` of a stage-3 bucket a PartitionedParameter, in place.

    Only the class changes (same tensor, same object: optimizer groups, tied modules and
    hooks still hold it). Parameters of other subclasses keep their class and behaviour.
    """
    if type(param) is nn.Parameter:
        param.__class__ = PartitionedParameter
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_next_ds_id)
        param.ds_active_sub_modules = set()  # DeepSpeed's; tools clear it (zero/parameter_offload.py)


def mark_whole(param: nn.Parameter) -> None:
    """Gives a ZeRO-3 model's parameter that stays whole (persistent or frozen) DeepSpeed's
    attributes, as DeepSpeed gives every parameter of such a model: its status is AVAILABLE."""
    if not hasattr(param, "ds_numel"):
        param.ds_shape = param.shape
        param.ds_numel = param.numel()
    mark_partitioned(param)
