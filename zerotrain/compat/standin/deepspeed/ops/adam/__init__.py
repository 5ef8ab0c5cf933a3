"""`deepspeed.ops.adam`."""

from zerotrain.optim.cpu_optimizers import DeepSpeedCPUAdam  # noqa: F401
from zerotrain.optim.fused_adam import FusedAdam  # noqa: F401
