"""`deepspeed.utils.z3_leaf_module`: ZeRO-3 leaf modules (mixture-of-experts blocks)."""

from zerotrain.zero.leaf_modules import (  # noqa: F401
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
