"""`deepspeed.runtime.fp16.loss_scaler`: the loss-scaler classes DeepSpeed's checkpoints pickle, as inert
stand-ins (state only), so DeepSpeed's own `zero_to_fp32.py` can unpickle its files under `zerotrain run`."""

from zerotrain.checkpoint.deepspeed_pickle import PickledDynamicLossScaler as DynamicLossScaler  # noqa: F401
from zerotrain.checkpoint.deepspeed_pickle import PickledLossScaler as LossScaler  # noqa: F401
