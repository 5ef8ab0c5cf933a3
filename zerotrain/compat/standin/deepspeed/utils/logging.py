"""`deepspeed.utils.logging`: DeepSpeed's logger is zerotrain's (Lightning sets its level)."""

import logging

logger = logging.getLogger("zerotrain")
