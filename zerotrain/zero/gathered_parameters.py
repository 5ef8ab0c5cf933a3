"""GatheredParameters: whole ZeRO-3 parameters for user code outside forward.

    with zerotrain.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()     # broadcast to every rank's shard on exit

Every rank must enter it with the same parameters (the gathers are collectives).
Parameters that are not partitioned (stages 0-2) are already whole: nothing happens.

Outside it (and outside their unit's forward and backward), stage-3 parameters are
`PartitionedParameter`s holding no values: `print(p)` says so and gives the full
shape (`p.ds_shape`), and `p.ds_status` is `ZeroParamStatus.NOT_AVAILABLE`. Inside it they are
whole, print as any `nn.Parameter`, and `p.ds_status` is `AVAILABLE`; `state_dict()` and
`copy.deepcopy` taken inside it hold the values.

Deferred parameters (a model built under `zero.Init`, not yet given to `initialize`;
on the meta device) work too, as Hugging Face's ZeRO-3 `from_pretrained` needs: inside,
each is a real, whole tensor on every rank (the same Parameter object: modules and
optimizer groups keep holding it), holding what was last written into it with a
`modifier_rank`. A deferred parameter nothing wrote yet reads as zeros (its
initializer runs only when `initialize` materializes the model), or as the value its
module's `__init__` gave it when that was small enough to keep. On exit with a
`modifier_rank` that rank's value is broadcast and every rank keeps only its 1/world
slice (deferred_values.py): the model is partitioned as it is loaded. Without one,
changes are dropped, as for partitioned parameters. Either way the parameter is back
on the meta device; `initialize` builds it from the slices.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.comm import distributed as zdist
from zerotrain.zero import deferred_values


class GatheredParameters:
    """Context manager gathering partitioned parameters; with `modifier_rank`, its edits persist."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ):
        """`fwd_module` is DeepSpeed's (it registers the parameters as external to that module's
        forward); zerotrain accepts it and has nothing to do with it here: use
        `register_external_parameter` for that."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # None entries are skipped: transformers passes `lm_head.bias` whether or not there is one.
        self.params = [p for p in params if p is not None] if enabled else []
        self.modifier_rank = modifier_rank
        self.flat_params = []
        for p in self.params:
            fp = getattr(p, "_zerotrain_flat_param", None)
            if fp is not None and all(fp is not seen for seen in self.flat_params):
                self.flat_params.append(fp)
        self.deferred: list[nn.Parameter] = []
        self._was_gathered: list[bool] = []

    def __enter__(self) -> "GatheredParameters":
        self._was_gathered = [fp.gathered for fp in self.flat_params]
        for fp in self.flat_params:
            fp.gather()
        # Looked up now, not at construction: a parameter already whole (an enclosing context
        # gathered it) is that context's to put back.
        self.deferred = list({id(p): p for p in self.params if deferred_values.is_deferred(p)}.values())
        self._enter_deferred()
        return self

    def __exit__(self, *exc) -> None:
        if self.modifier_rank is not None:
            with torch.no_grad():
                for fp in self.flat_params:
                    if dist.is_initialized() and dist.get_world_size() > 1:
                        zdist.broadcast(fp.data, self.modifier_rank, "param")
                    # the shard and master may be parked on NVMe: set_shard brings them in
                    fp.set_shard(fp.data[fp.shard_start : fp.shard_start + fp.shard_size], with_master=True)
        for fp, was in zip(self.flat_params, self._was_gathered):
            if not was:
                fp.free(hand_over=True)  # tensors the user took inside stay valid (see FlatParam.free)
        self._exit_deferred()

    # --- deferred parameters (built under zero.Init, before initialize) -----------------------

    def _enter_deferred(self) -> None:
        device = deferred_values.comm_device()
        with torch.no_grad():
            for p in self.deferred:
                if deferred_values.has_stored_value(p):
                    value = deferred_values.gather_whole(p, device)
                else:
                    value = deferred_values.initial_value(p, device)
                deferred_values.replace_tensor(p, value)

    def _exit_deferred(self) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        with torch.no_grad():
            for p in self.deferred:
                if self.modifier_rank is not None:
                    value = p.detach().to(deferred_values.comm_device()).contiguous()
                    if world > 1:
                        zdist.broadcast(value, self.modifier_rank, "init")
                    deferred_values.store(p, value)
                deferred_values.replace_tensor(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
        self.deferred = []

