"""`deepspeed.runtime.zero.config`: `ZeroStageEnum`, which DeepSpeed's checkpoints pickle (an inert stand-in)."""

from zerotrain.checkpoint.deepspeed_pickle import PickledZeroStage as ZeroStageEnum  # noqa: F401
