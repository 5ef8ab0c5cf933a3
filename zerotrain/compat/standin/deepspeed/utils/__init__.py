"""`deepspeed.utils`: the logger, and refusals for what zerotrain does not have."""

from deepspeed.utils.logging import logger  # noqa: F401  (`deepspeed.utils.logging` is the module, as in DeepSpeed)
from zerotrain.compat.unsupported_features import set_z3_leaf_modules  # noqa: F401
