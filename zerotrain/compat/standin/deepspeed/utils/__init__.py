"""`deepspeed.utils`: the logger, and refusals for what zerotrain does not have."""

import logging

from zerotrain.compat.unsupported_features import set_z3_leaf_modules  # noqa: F401

logger = logging.getLogger("zerotrain")
