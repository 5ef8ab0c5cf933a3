"""`deepspeed.ops.adam`."""

from zerotrain.optim.cpu_optimizers import DeepSpeedCPUAdam  # noqa: F401
