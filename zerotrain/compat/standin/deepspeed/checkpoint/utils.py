"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""

from zerotrain.checkpoint.tensor_copies import clone_tensors_for_torch_save  # noqa: F401
