"""`deepspeed.ops.lion`."""

from zerotrain.optim.cpu_optimizers import DeepSpeedCPULion  # noqa: F401
