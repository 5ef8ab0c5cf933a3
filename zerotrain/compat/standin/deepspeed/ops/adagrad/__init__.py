"""`deepspeed.ops.adagrad`."""

from zerotrain.optim.cpu_optimizers import DeepSpeedCPUAdagrad  # noqa: F401
