"""The ``zero_optimization`` section: ZeRO stage, buckets, offload, stage-3 knobs.

Key names, aliases and defaults follow DeepSpeed's ZeRO config so that existing
DeepSpeed JSON files load unchanged.  Stage-3 keys are written ``stage3_*`` in
JSON (the alias); the attribute drops the prefix, as in DeepSpeed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, model_validator

from zerotrain.config.schema_types import (
    AutoNonNegativeInt,
    ConfigSection,
    Fraction,
    NonNegativeInt,
    config_problem,
)

OffloadDevice = Literal["none", "cpu", "nvme"]

_NVME_PATH_MISSING = 'device is "nvme" but nvme_path is not set: set nvme_path to a directory on a local fast disk'


# DeepSpeed 0.19.8's default `leaf_module.classes` (runtime/zero/leaf_module_config.py): its engine flags
# these mixture-of-experts blocks as ZeRO-3 leaves unless the config lists other classes.
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(ConfigSection):
    """Modules ZeRO-3 gathers whole, never split into units (``leaf_module``, DeepSpeed >= 0.17)."""

    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Class names, plain or module-qualified; default: Mixtral's, Qwen2-MoE's and Qwen3-MoE's MoE blocks."""
    names: list[str] = []
    """Module names as model.named_modules() gives them (e.g. "model.layers.0.mlp")."""
    name_suffixes: list[str] = []
    """Ends of module names (e.g. "mlp"): every module whose name ends so."""

    @model_validator(mode="before")
    @classmethod
    def _one_as_list(cls, data: Any) -> Any:
        """As DeepSpeed: a single string stands for a list of one."""
        if not isinstance(data, Mapping):
            return data
        return {k: [v] if k in ("classes", "names", "name_suffixes") and isinstance(v, str) else v
                for k, v in data.items()}


class OffloadParamConfig(ConfigSection):
    """Where ZeRO-3 keeps parameter shards between uses (``offload_param``)."""

    device: OffloadDevice = "none"
    """Where parameter shards live: "none" (accelerator memory), "cpu" or "nvme"."""
    nvme_path: Path | None = None
    """Directory on a fast local disk for parameter swap files (device "nvme")."""
    pin_memory: bool = False
    """Keep CPU copies in page-locked memory for faster host-device copies."""
    buffer_count: NonNegativeInt = 5
    """Number of buffers in the NVMe parameter swap pool."""
    buffer_size: NonNegativeInt = 100_000_000
    """Size of each NVMe parameter swap buffer, in elements."""
    max_in_cpu: NonNegativeInt = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe."""

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadParamConfig":
        if self.device == "nvme" and self.nvme_path is None:
            raise config_problem(_NVME_PATH_MISSING)
        return self


class OffloadOptimizerConfig(ConfigSection):
    """Where the fp32 master weights and optimizer state live (``offload_optimizer``)."""

    device: OffloadDevice = "none"
    """Where optimizer state lives: "none" (accelerator memory), "cpu" or "nvme"."""
    nvme_path: Path | None = None
    """Directory on a fast local disk for optimizer-state swap files (device "nvme")."""
    pin_memory: bool = False
    """Keep CPU copies in page-locked memory for faster host-device copies."""
    buffer_count: NonNegativeInt = 4
    """Number of buffers in the NVMe optimizer-state swap pool."""
    fast_init: bool = False
    """Initialize NVMe-offloaded optimizer state quickly."""
    ratio: Fraction = 1.0
    """Fraction of optimizer state offloaded (below 1.0 only with ZeRO-3)."""
    pipeline_read: bool = False
    """Overlap reading the next optimizer tile from NVMe with the current step."""
    pipeline_write: bool = False
    """Overlap writing the previous optimizer tile to NVMe with the current step."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload for superchips (ZeRO-3 only)."""
    convert_grad_on_cpu: bool = True
    """Convert gradients to fp32 on the CPU rather than on the accelerator."""
    cpuadam_cores_perc: Fraction = 0.8
    """Fraction of CPU cores the CPU optimizer may use (with super_offload)."""

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> "OffloadOptimizerConfig":
        if self.device == "nvme" and self.nvme_path is None:
            raise config_problem(_NVME_PATH_MISSING)
        return self


# Old DeepSpeed spellings, translated before validation: old key -> new key.
_RENAMED_KEYS = {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
# Old boolean switches that create an offload section with device "cpu".
_OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
_PIN_MEMORY_SWITCH = "cpu_offload_use_pin_memory"


class ZeroConfig(ConfigSection):
    """ZeRO partitioning: which training state is sharded across data-parallel ranks."""

    extra_accepted_keys = (*_RENAMED_KEYS, *_OFFLOAD_SWITCHES, _PIN_MEMORY_SWITCH)

    stage: int = Field(0, ge=0, le=3)
    """0: plain data parallel; 1: shard optimizer state; 2: also gradients; 3: also parameters."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: bool = True
    """Average gradients with reduce-scatter rather than all-reduce."""
    reduce_bucket_size: AutoNonNegativeInt = 500_000_000
    """Elements reduced at a time; "auto" = hidden_size * hidden_size."""
    use_multi_rank_bucket_allreduce: bool = True
    """Combine the reduce buckets of different ranks into one all-reduce."""
    allgather_partitions: bool = True
    """Gather updated parameters with all-gather (true) or a series of broadcasts (false)."""
    allgather_bucket_size: NonNegativeInt = 500_000_000
    """Elements all-gathered at a time after the optimizer step."""
    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; unset means true at stage 3, false below."""
    load_from_fp32_weights: bool = True
    """Initialize fp32 master weights from the checkpoint's fp32 copy rather than 16-bit weights."""
    elastic_checkpoint: bool = False
    """DeepSpeed's checkpoints loadable at another world size; accepted, a no-op: zerotrain's always are."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that get no gradient instead of raising."""
    legacy_stage1: bool = False
    """DeepSpeed's old stage-1 implementation switch; accepted for compatibility."""
    round_robin_gradients: bool = False
    """Stage 1/2 with CPU offload: spread gradient copies to the CPU over ranks."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload to CPU or NVMe (ZeRO-3 only)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload to CPU or NVMe (stages 1-3)."""
    sub_group_size: NonNegativeInt = 1_000_000_000
    """Tile size, in elements, for the offloaded optimizer step."""

    # ---- stage 3 (JSON names carry the stage3_ prefix) ----
    prefetch_bucket_size: AutoNonNegativeInt = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    """Parameter elements fetched ahead of use; "auto" = 0.9 * hidden_size * hidden_size."""
    param_persistence_threshold: AutoNonNegativeInt = Field(100_000, alias="stage3_param_persistence_threshold")
    """Parameters smaller than this stay whole on every rank; "auto" = 10 * hidden_size."""
    model_persistence_threshold: NonNegativeInt = Field(sys.maxsize, alias="stage3_model_persistence_threshold")
    """Upper bound on the total elements kept whole by param_persistence_threshold."""
    max_live_parameters: NonNegativeInt = Field(1_000_000_000, alias="stage3_max_live_parameters")
    """Parameter elements resident per rank before releasing gathered ones."""
    max_reuse_distance: NonNegativeInt = Field(1_000_000_000, alias="stage3_max_reuse_distance")
    """Keep a gathered parameter if it is reused within this many elements."""
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    """Gather full 16-bit weights when saving the model (old name: stage3_gather_fp16_weights_on_model_save)."""
    module_granularity_threshold: int = Field(0, alias="stage3_module_granularity_threshold")
    """Treat modules finer than this granularity as one fetch unit."""
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    """Fetch parameters with all-reduce instead of all-gather."""
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    """Gather parameters one by one rather than in buckets."""
    partition_stream_chunk_size: NonNegativeInt = Field(0, alias="stage3_partition_stream_chunk_size")
    """Partition huge parameters through chunks of this many elements (0 = off)."""

    # ---- ZeRO++, MiCS and other DeepSpeed extensions ----
    zero_hpz_partition_size: NonNegativeInt = 1
    """ZeRO++ hierarchical partitioning: ranks in the secondary parameter group (1 = off)."""
    zero_quantized_weights: bool = False
    """ZeRO++: quantize weights for the all-gather."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: store frozen weights quantized."""
    zero_quantized_gradients: bool = False
    """ZeRO++: quantize gradients for the reduction."""
    zeropp_loco_param: dict[str, Any] | None = None
    """LoCo-ZeRO++ error-feedback settings (err_beta, reset_T)."""
    mics_shard_size: int = -1
    """MiCS: shard parameters within groups of this many ranks (-1 = off)."""
    mics_hierarchical_params_gather: bool = False
    """MiCS: gather parameters hierarchically."""
    memory_efficient_linear: bool = True
    """Stage 3: use a memory-efficient linear layer implementation."""
    pipeline_loading_checkpoint: bool = False
    """Stage 3: load checkpoints in pipeline mode."""
    override_module_apply: bool = True
    """Stage 3: wrap nn.Module.apply so it sees gathered parameters."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log parameter-trace cache invalidations."""
    enable_sanity_checks: bool = False
    """Run internal consistency checks (slow; for debugging)."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Stage 3 with NVMe: keep the Muon momentum buffer in memory."""
    leaf_module: LeafModuleConfig | None = None
    """Stage 3: modules gathered whole (classes, names, name_suffixes); unset: DeepSpeed's default MoE classes."""
    zenflow: dict[str, Any] | None = None
    """DeepSpeed ZenFlow settings (not built in zerotrain)."""

    @model_validator(mode="before")
    @classmethod
    def _translate_old_keys(cls, data: Any) -> Any:
        """Accept DeepSpeed's deprecated spellings by rewriting them to current keys."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for old, new in _RENAMED_KEYS.items():
            if old in data:
                value = data.pop(old)
                if new in data and data[new] != value:
                    raise config_problem(
                        f"both '{old}' (old name) and '{new}' are set, to different values: keep only '{new}'"
                    )
                data[new] = value
        pin = data.pop(_PIN_MEMORY_SWITCH, None)
        if pin is not None and not isinstance(pin, bool):
            raise config_problem(f"{_PIN_MEMORY_SWITCH}: got {pin!r}, expected true or false")
        for switch, section in _OFFLOAD_SWITCHES.items():
            if switch not in data:
                continue
            enabled = data.pop(switch)
            if enabled is None:
                continue
            if not isinstance(enabled, bool):
                raise config_problem(f"{switch}: got {enabled!r}, expected true or false")
            if not enabled:
                continue
            current = data.get(section)
            device = current.get("device", "none") if isinstance(current, Mapping) else None
            if current is not None and device != "cpu":
                raise config_problem(
                    f"'{switch}': true (deprecated) asks for {section} on the CPU, but '{section}' says "
                    f"device {device!r}: remove '{switch}' and keep '{section}'"
                )
            if current is None:
                data[section] = {"device": "cpu", "pin_memory": bool(pin)}
        return data

    @model_validator(mode="after")
    def _deepspeed_consistency(self) -> "ZeroConfig":
        # DeepSpeed overlaps communication by default only at stage 3.
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise config_problem("offload_optimizer.ratio below 1.0 (partial offload) needs stage 3: set ratio to 1.0")
        return self
