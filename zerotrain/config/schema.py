"""The zerotrain configuration: DeepSpeed's JSON keys, aliases and defaults.

``ZeroTrainConfig`` is what ``load_config`` returns.  Values a user wrote as
"auto" stay the string "auto" until ``resolve_config`` replaces them.  The ZeRO
section lives in ``zero_schema``; profiling, monitoring and checkpoint-I/O
sections live in ``feature_schema``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import Field, field_validator, model_validator

from zerotrain.config.compile_schema import CompileConfig
from zerotrain.config.feature_schema import (
    ActivationCheckpointingConfig,
    AutotuningConfig,
    CheckpointConfig,
    CometConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    TrackioConfig,
    WandbConfig,
)
from zerotrain.config.schema_types import (
    AutoBool,
    AutoPositiveInt,
    Auto,
    ConfigSection,
    NonNegativeFloat,
    PositiveInt,
    config_problem,
)
from zerotrain.config.zero_schema import ZeroConfig

if TYPE_CHECKING:  # torch is imported where a dtype is asked for: `zerotrain config check` stays light
    import torch

# DeepSpeed top-level keys zerotrain does not model field by field.  They are
# accepted so that copied DeepSpeed files load, kept in
# ``ZeroTrainConfig.other_deepspeed_keys``, and refused by ``check_supported``
# as soon as one of them is switched on.
DEEPSPEED_KEYS_NOT_MODELED = frozenset({
    "aio",
    "amp",
    "comms_logger",
    "compression_training",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "dataloader_drop_last",
    "disable_allgather",
    "elasticity",
    "graph_harvesting",
    "hybrid_engine",
    "memory_breakdown",
    "nebula",
    "pipeline",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
    "tensor_parallel",
    "torch_autocast",
    "weight_quantization",
})

_TORCH_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class FP16Config(ConfigSection):
    """fp16 mixed precision with DeepSpeed's dynamic loss scaling (``fp16``)."""

    enabled: AutoBool = False
    """Train in fp16; "auto" follows the model's parameter dtype."""
    auto_cast: bool = False
    """Cast floating-point inputs of the model's forward to fp16."""
    loss_scale: NonNegativeFloat = 0.0
    """Static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: PositiveInt = 1000
    """Steps without overflow before the dynamic scale is raised."""
    hysteresis: PositiveInt = 2
    """Overflows tolerated before the dynamic scale is lowered."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: NonNegativeFloat = 1
    """Floor of the dynamic loss scale."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (DeepSpeed CPU-Adam only)."""


class BF16Config(ConfigSection):
    """bfloat16 mixed precision (``bf16``; DeepSpeed's old name ``bfloat16`` is accepted)."""

    enabled: AutoBool = False
    """Train in bf16; "auto" follows the model's parameter dtype."""
    immediate_grad_update: bool = False
    """DeepSpeed bf16 optimizer: apply gradients to fp32 master copies immediately."""
    check_grad_overflow: bool = False
    """Check bf16 gradients for inf/nan before stepping."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in bf16 instead of fp32."""
    bf16_optimizer_states: bool = False
    """Keep optimizer state in bf16 (needs bf16_master_weights_and_grads)."""


class OptimizerConfig(ConfigSection):
    """The optimizer zerotrain builds (``optimizer``)."""

    type: str
    """Optimizer name, e.g. "Adam", "AdamW"; checked by the optimizer builder."""
    params: dict[str, Any] = {}
    """Keyword arguments for the optimizer (lr, betas, eps, weight_decay, ...); values may be "auto"."""
    legacy_fusion: bool = False
    """DeepSpeed's legacy fused-optimizer switch; accepted for compatibility."""


class SchedulerConfig(ConfigSection):
    """The learning-rate schedule zerotrain builds (``scheduler``)."""

    type: str
    """Schedule name, e.g. "WarmupLR", "WarmupDecayLR"; checked by the scheduler builder."""
    params: dict[str, Any] = {}
    """Keyword arguments of the schedule; values may be "auto"."""


class ZeroTrainConfig(ConfigSection):
    """A whole training configuration, in DeepSpeed's JSON layout."""

    extra_accepted_keys = ("bfloat16", *sorted(DEEPSPEED_KEYS_NOT_MODELED))

    # ---- batch ----
    train_batch_size: AutoPositiveInt | None = None
    """Samples per optimizer step over all ranks = micro batch x accumulation x world size."""
    train_micro_batch_size_per_gpu: AutoPositiveInt | None = None
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: AutoPositiveInt | None = None
    """Micro batches accumulated before each optimizer step."""

    # ---- optimization ----
    gradient_clipping: NonNegativeFloat | Auto = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    optimizer: OptimizerConfig | None = None
    """Optimizer to build; leave out when passing your own optimizer."""
    scheduler: SchedulerConfig | None = None
    """Learning-rate schedule to build; leave out when passing your own."""
    zero_allow_untested_optimizer: bool = False
    """Allow a client optimizer that DeepSpeed has not tested with ZeRO."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed: require its CPU optimizer with offload; accepted for compatibility."""

    # ---- precision ----
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision and loss scaling."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision."""

    # ---- ZeRO and communication ----
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and its knobs."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype gradients are reduced in; unset means the training dtype."""
    prescale_gradients: bool = False
    """Divide gradients by the world size before the reduction instead of after (stage 0; stages
    1-3 always divide before, as DeepSpeed's ZeRO optimizers do, so fp16 sums cannot overflow)."""
    gradient_predivide_factor: float = Field(1.0, gt=0)
    """Divide gradients by this factor before the reduction and by world/factor after."""

    # ---- sequence parallelism (zerotrain/sequence/) ----
    sequence_parallel_size: PositiveInt = 1
    """Ulysses sequence parallelism: ranks (N consecutive) that share each sequence, each holding
    1/N of it; must divide the world size. The batch sizes count sequence groups (world / N)."""
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """With sequence_parallel_size > 1, the dtype gradients are reduced in, in place of
    communication_data_type (DeepSpeed's meaning; unset means fp32, DeepSpeed's default)."""

    # ---- logging ----
    steps_per_print: PositiveInt = 10
    """Print progress every this many optimizer steps. Infinity (what Accelerate writes to
    silence DeepSpeed) means never."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately."""
    dump_state: bool = False
    """Print the engine state after initialization."""

    # ---- feature sections ----
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """DeepSpeed's activation checkpointing."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""
    trackio: TrackioConfig = Field(default_factory=TrackioConfig)
    """Trackio monitor."""
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """DeepSpeed autotuner."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint I/O options."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """torch.compile of each layer and the loss (config/compile_schema.py)."""

    other_deepspeed_keys: dict[str, Any] = {}
    """DeepSpeed keys zerotrain accepts but does not model (see DEEPSPEED_KEYS_NOT_MODELED)."""

    @model_validator(mode="before")
    @classmethod
    def _accept_deepspeed_spellings(cls, data: Any) -> Any:
        """Rewrite DeepSpeed's alternative spellings into the fields above."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "bfloat16" in data:
            if "bf16" in data:
                raise config_problem("both 'bf16' and its old name 'bfloat16' are set: keep only 'bf16'")
            data["bf16"] = data.pop("bfloat16")
        # DeepSpeed's oldest format: "zero_optimization": true means stage 1.
        if isinstance(data.get("zero_optimization"), bool):
            data["zero_optimization"] = {"stage": 1 if data["zero_optimization"] else 0}
        unmodeled = {key: data.pop(key) for key in list(data) if key in DEEPSPEED_KEYS_NOT_MODELED}
        if unmodeled:
            data["other_deepspeed_keys"] = {**dict(data.get("other_deepspeed_keys") or {}), **unmodeled}
        return data

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinity_means_never(cls, value: Any) -> Any:
        # Accelerate writes float("inf") to keep DeepSpeed quiet; a step count never reaches it.
        return 2**63 - 1 if isinstance(value, float) and value == float("inf") else value

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _lower_case_dtype(cls, value: Any) -> Any:
        # DeepSpeed lower-cases this value, so "FP32" is valid there.
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_precision(self) -> "ZeroTrainConfig":
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise config_problem(
                "fp16.enabled and bf16.enabled are both true: "
                "choose one mixed-precision mode and set the other to false"
            )
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of forward/backward: fp16, bf16 or fp32 (meaningful after resolve_config)."""
        import torch

        if self.fp16.enabled is True:
            return torch.float16
        if self.bf16.enabled is True:
            return torch.bfloat16
        return torch.float32

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage, 0 to 3."""
        return int(self.zero_optimization.stage)

    @property
    def gradient_communication_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in: ``communication_data_type``, or with sequence
        parallelism ``seq_parallel_communication_data_type`` (fp32 when unset), as DeepSpeed does."""
        import torch

        if self.sequence_parallel_size == 1:
            return self.communication_dtype
        return getattr(torch, _TORCH_DTYPE_NAMES[self.seq_parallel_communication_data_type or "fp32"])

    @property
    def communication_dtype(self) -> torch.dtype | None:
        """``communication_data_type`` as a torch dtype, or None when unset."""
        import torch

        if self.communication_data_type is None:
            return None
        return getattr(torch, _TORCH_DTYPE_NAMES[self.communication_data_type])
