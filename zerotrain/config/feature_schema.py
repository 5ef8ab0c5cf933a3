"""Sections for features around the training step: activation checkpointing,
profiling, experiment monitors, autotuning and checkpoint I/O.

They carry DeepSpeed's keys and defaults so existing files load; whether a
feature is built yet is decided by ``zerotrain.config.unsupported``, not here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from zerotrain.config.schema_types import ConfigSection, NonNegativeFloat, PositiveInt


class ActivationCheckpointingConfig(ConfigSection):
    """DeepSpeed's activation checkpointing options (``activation_checkpointing``)."""

    partition_activations: bool = False
    """Partition checkpointed activations across model-parallel ranks."""
    contiguous_memory_optimization: bool = False
    """Copy checkpointed activations into one contiguous buffer."""
    cpu_checkpointing: bool = False
    """Move checkpointed activations to CPU memory."""
    number_checkpoints: int | None = None
    """Number of checkpoints the contiguous buffer is sized for."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at each checkpoint boundary."""
    profile: bool = False
    """Log the time spent in checkpointed forward and recomputation."""


class FlopsProfilerConfig(ConfigSection):
    """DeepSpeed's FLOPs profiler (``flops_profiler``)."""

    enabled: bool = False
    """Profile one training step and print FLOPs, latency and parameter counts."""
    recompute_fwd_factor: NonNegativeFloat = 0.0
    """Extra forward passes from activation recomputation, for FLOPs accounting."""
    profile_step: int = 1
    """Training step at which to profile."""
    module_depth: int = -1
    """Depth of the module tree to report (-1 = all)."""
    top_modules: int = 1
    """Number of top modules to list."""
    detailed: bool = True
    """Print the per-module profile."""
    output_file: str | None = None
    """Write the profile to this file instead of stdout."""


class TensorBoardConfig(ConfigSection):
    """TensorBoard logging (``tensorboard``)."""

    enabled: bool = False
    """Write training metrics as TensorBoard events."""
    output_path: str = ""
    """Directory for the event files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run."""


class WandbConfig(ConfigSection):
    """Weights & Biases logging (``wandb``)."""

    enabled: bool = False
    """Send training metrics to Weights & Biases."""
    group: str | None = None
    """Run group."""
    team: str | None = None
    """Team (entity)."""
    project: str = "deepspeed"
    """Project name."""


class CSVMonitorConfig(ConfigSection):
    """Local CSV logging (``csv_monitor``)."""

    enabled: bool = False
    """Write training metrics to CSV files."""
    output_path: str = ""
    """Directory for the CSV files."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run."""


class CometConfig(ConfigSection):
    """Comet logging (``comet``)."""

    enabled: bool = False
    """Send training metrics to Comet."""
    samples_log_interval: PositiveInt = 100
    """Log every this many samples."""
    project: str | None = None
    """Comet project."""
    workspace: str | None = None
    """Comet workspace."""
    api_key: str | None = None
    """Comet API key."""
    experiment_name: str | None = None
    """Experiment name."""
    experiment_key: str | None = None
    """Key of an existing experiment to continue."""
    online: bool | None = None
    """Log to the Comet server (true) or offline (false)."""
    mode: str | None = None
    """"get", "create" or "get_or_create"."""


class TrackioConfig(ConfigSection):
    """Trackio logging (``trackio``)."""

    enabled: bool = False
    """Send training metrics to Trackio."""
    project: str = "deepspeed"
    """Project name."""


class AutotuningConfig(ConfigSection):
    """DeepSpeed's autotuner (``autotuning``)."""

    enabled: bool = False
    """Search ZeRO stage and micro-batch size for the fastest configuration."""
    fast: bool = True
    """Tune only micro-batch size and ZeRO stage."""
    results_dir: str = "autotuning_results"
    """Directory for tuning results."""
    exps_dir: str = "autotuning_exps"
    """Directory for the experiment configs."""
    overwrite: bool = True
    """Overwrite earlier results."""
    start_step: int | None = None
    """Older spelling of start_profile_step found in DeepSpeed's docs."""
    end_step: int | None = None
    """Older spelling of end_profile_step found in DeepSpeed's docs."""
    start_profile_step: int = 3
    """First step measured in each experiment."""
    end_profile_step: int = 5
    """Last step measured in each experiment."""
    metric: str = "throughput"
    """What to optimize: "throughput", "latency" or "flops"."""
    metric_path: str | None = None
    """Where experiments write their metric."""
    tuner_type: str = "gridsearch"
    """"gridsearch", "random" or "model_based"."""
    tuner_early_stopping: int = 5
    """Stop after this many experiments without improvement."""
    tuner_num_trials: int = 50
    """Maximum number of experiments."""
    arg_mappings: dict[str, Any] | None = None
    """Map of config keys to training-script arguments."""
    model_info: dict[str, Any] | None = None
    """Model facts for the tuner (num_params, hidden_size, num_layers, profile)."""
    model_info_path: str | None = None
    """File holding model_info."""
    mp_size: int = 1
    """Model-parallel size."""
    max_train_batch_size: int | None = None
    """Largest global batch to try."""
    min_train_batch_size: int = 1
    """Smallest global batch to try."""
    max_train_micro_batch_size_per_gpu: int = 1024
    """Largest micro-batch to try."""
    min_train_micro_batch_size_per_gpu: int = 1
    """Smallest micro-batch to try."""
    num_tuning_micro_batch_sizes: int = 3
    """Number of micro-batch sizes to try."""


class ParallelWriteConfig(ConfigSection):
    """Parallel checkpoint writing (``checkpoint.parallel_write``)."""

    pipeline_stage: bool = False
    """Each pipeline stage writes its own part of the checkpoint."""


class CheckpointConfig(ConfigSection):
    """Checkpoint I/O options (``checkpoint``)."""

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = "WARN"
    """What to do when ranks disagree on the checkpoint tag: Warn, Ignore or Fail."""
    load_universal: bool = False
    """Load a universal (topology-independent) checkpoint."""
    use_node_local_storage: bool = False
    """Save to node-local storage, one copy per node."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel checkpoint writing."""
    checkpoint_serialization: bool = True
    """Serialize tensors with torch.save's zipfile format."""
    writer: dict[str, Any] | None = None
    """DeepSpeed's checkpoint-writer settings (type, io_buffer_size, ...)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _case_insensitive(cls, value: Any) -> Any:
        # DeepSpeed upper-cases the mode, so "Warn", "warn" and "WARN" are all valid.
        return value.upper() if isinstance(value, str) else value
