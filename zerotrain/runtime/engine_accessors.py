"""DeepSpeed's engine accessors, under DeepSpeed's names, with DeepSpeed's return values.

A mixin of `Engine`: the methods read the engine's config, counters and optimizer, and
change nothing. Where DeepSpeed's value is surprising it is kept and said so below
(e.g. `zero_optimization()` is a bool, not the section), because scripts test them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.zero.optimizer import ZeroOptimizer
    from zerotrain.zero.stage import StagePlan

# Optimizers whose momentum DeepSpeed's get_mom() reads from "momentum"; all others from "betas".
_MOMENTUM_KEY_OPTIMIZERS = ("SGD", "RMSprop")


class DeepSpeedAccessors:
    """`engine.train_batch_size()`, `engine.get_lr()`, `engine.was_step_applied()`, ..."""

    parsed_config: ZeroTrainConfig
    config: dict
    plan: StagePlan
    optimizer: ZeroOptimizer
    rank: int
    world_size: int
    micro_steps: int
    # DeepSpeed's _step_applied: False until a step() updates the weights; the engine sets it.
    _step_applied: bool = False
    # Settles a pending fp16 step (StepSettlement, step_settlement.py): what depends on its outcome calls it.
    _settle_step: Callable[[], None]

    # --- process layout --------------------------------------------------------------------

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (DeepSpeed's attribute)."""
        return self.rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel processes: every process, since zerotrain is data-parallel only."""
        return self.world_size

    # --- batch sizes and accumulation ------------------------------------------------------

    # Set by set_gradient_accumulation_boundary(): the caller (Accelerate, the HF Trainer)
    # decides where accumulations end instead of the micro-step counter.
    _boundary_override: bool | None = None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` updates the weights (it ends an accumulation)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Makes the coming backward and step end an accumulation (True) or not (False), whatever
        the micro-step count says: for loops that count accumulation themselves."""
        self._boundary_override = bool(is_boundary)

    def train_batch_size(self) -> int:
        return self.parsed_config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.parsed_config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.parsed_config.gradient_accumulation_steps

    # --- ZeRO and the optimizer ------------------------------------------------------------

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on, i.e. stage > 0 (DeepSpeed returns this bool, not the section)."""
        return self.plan.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def gradient_clipping(self) -> float:
        """The configured max global gradient norm; 0 means no clipping."""
        return self.parsed_config.gradient_clipping

    def get_lr(self) -> list[float]:
        """The lr of every param group (after an fp16 step: as settled, a host read)."""
        self._settle_step()
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Every param group's momentum: `momentum` for SGD and RMSprop, else `betas`; 0.0 for a
        group without that key (Adagrad), as DeepSpeed."""
        name = type(self.optimizer.optimizer).__name__
        key = "momentum" if name in _MOMENTUM_KEY_OPTIMIZERS else "betas"
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Norm of the whole (unscaled, unclipped) gradient at the last step; inf if fp16 overflowed.
        It stays on the device until asked for: this is a host read."""
        return self.optimizer.last_grad_norm

    def fp16_enabled(self) -> bool:
        return self.parsed_config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.parsed_config.bf16.enabled

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether stage 3 gathers whole 16-bit weights when the model is saved (the config key)."""
        return self.parsed_config.zero_optimization.gather_16bit_weights_on_model_save

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` changed the weights: False before any step, after a step
        inside an accumulation, and after an fp16 overflow skipped the update (a host read then)."""
        self._settle_step()
        return self._step_applied
