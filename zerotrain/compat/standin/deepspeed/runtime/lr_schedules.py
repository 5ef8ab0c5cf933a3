"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedules, built by zerotrain (zerotrain/optim/schedules.py)."""

from zerotrain.optim.schedules import SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

VALID_LR_SCHEDULES = list(SCHEDULES)
