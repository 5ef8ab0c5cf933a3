"""`deepspeed.checkpointing`: DeepSpeed's activation checkpointing API, on torch's checkpoint.

Lightning calls `configure(...)` whenever its DeepSpeed strategy sets up, with DeepSpeed's defaults
unless the user asks for more; model code calls `checkpoint(function, *args)`. Partitioned or
CPU-kept activations are DeepSpeed features zerotrain does not have: asking for them is refused.
"""

from __future__ import annotations

import torch.utils.checkpoint


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Accepts DeepSpeed's settings; refuses the ones that would change what is kept."""
    asked = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "checkpoint_in_cpu": checkpoint_in_cpu}
    on = [name for name, value in asked.items() if value]
    if on:
        raise NotImplementedError(
            f"deepspeed.checkpointing.configure({', '.join(f'{n}=True' for n in on)}): not supported by zerotrain; "
            "activation checkpointing here is torch's (torch.utils.checkpoint), which keeps activations whole "
            "on the device: leave these options off")


def is_configured() -> bool:
    return True


def checkpoint(function, *args):
    """Recomputes `function(*args)` in backward (torch's non-reentrant checkpoint)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
