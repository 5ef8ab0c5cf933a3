"""`deepspeed.utils.tensor_fragment`: `fragment_address`, which DeepSpeed's checkpoints pickle (an inert stand-in)."""

from zerotrain.checkpoint.deepspeed_pickle import PickledFragmentAddress as fragment_address  # noqa: F401
