"""GatheredParameters: whole ZeRO-3 parameters for user code outside forward.

    with zerotrain.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()     # broadcast to every rank's shard on exit

Every rank must enter it with the same parameters (the gathers are collectives).
Parameters that are not partitioned (stages 0-2) are already whole: nothing happens.

Outside it (and outside their unit's forward and backward), stage-3 parameters are
`PartitionedParameter`s holding no values: `print(p)` says so and gives the full
shape (`p.ds_shape`), and `p.ds_status` is "partitioned". Inside it they are whole,
print as any `nn.Parameter`, and `p.ds_status` is "gathered"; `state_dict()` and
`copy.deepcopy` taken inside it hold the values.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zerotrain import distributed as zdist


class GatheredParameters:
    """Context manager gathering partitioned parameters; with `modifier_rank`, its edits persist."""

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None, enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.flat_params = []
        if enabled:
            for p in params:
                fp = getattr(p, "_zerotrain_flat_param", None)
                if fp is not None and all(fp is not seen for seen in self.flat_params):
                    self.flat_params.append(fp)
        self._was_gathered: list[bool] = []

    def __enter__(self) -> "GatheredParameters":
        self._was_gathered = [fp.gathered for fp in self.flat_params]
        for fp in self.flat_params:
            fp.gather()
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
                fp.free()
