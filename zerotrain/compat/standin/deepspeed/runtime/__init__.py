"""`deepspeed.runtime` (its submodules are attributes once `deepspeed` is imported, as in DeepSpeed)."""

from deepspeed.runtime import engine, lr_schedules, zero  # noqa: F401
