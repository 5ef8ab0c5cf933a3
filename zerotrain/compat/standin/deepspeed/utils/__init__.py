"""`deepspeed.utils`: the logger, and ZeRO-3 leaf modules (mixture-of-experts blocks)."""

from deepspeed.utils.logging import logger  # noqa: F401  (`deepspeed.utils.logging` is the module, as in DeepSpeed)
from deepspeed.utils.z3_leaf_module import (  # noqa: F401
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
