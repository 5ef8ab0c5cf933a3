"""`deepspeed.runtime.zero.partition_parameters`: the names transformers, TRL and training scripts
reach for (`ZeroParamStatus` beside `param.ds_status`).

transformers swaps `zero_wrapper_for_fp_tensor_constructor` around `zero.Init` to keep
`torch.arange`'s dtype; zerotrain's Init never rewrites tensor constructors, so the hook is
kept only so that swap finds what it expects.
"""

import torch

from zerotrain.compat.accelerator import get_accelerator  # noqa: F401
from zerotrain.zero import GatheredParameters, Init  # noqa: F401
from zerotrain.zero.partitioned_param import ZeroParamStatus  # noqa: F401  (TRL, LLaVA-style maybe_zero_3)

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """Returns `fn` unchanged: zerotrain's Init leaves tensor constructors alone."""
    return fn
