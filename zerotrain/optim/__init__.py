"""Optimizers and learning-rate schedules, configured with DeepSpeed's names and semantics."""

from zerotrain.optim.cpu_optimizers import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion
from zerotrain.optim.lamb import Lamb
from zerotrain.optim.lion import Lion
from zerotrain.optim.optimizers import SUPPORTED_OPTIMIZERS, build_optimizer
from zerotrain.optim.schedules import (
    SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "SCHEDULES",
    "SUPPORTED_OPTIMIZERS",
    "DeepSpeedCPUAdagrad",
    "DeepSpeedCPUAdam",
    "DeepSpeedCPULion",
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
]
