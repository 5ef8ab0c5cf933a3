"""`deepspeed.checkpoint.constants`: the key names of DeepSpeed's checkpoint files.

The `zero_to_fp32.py` DeepSpeed copies into every checkpoint folder imports these; with them (and the
classes its pickles name, `deepspeed/runtime/fp16/loss_scaler.py` & co. here) that script runs under
`zerotrain run python zero_to_fp32.py ...` with no DeepSpeed installed.
"""

DS_VERSION = "ds_version"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_FLAT_GROUPS = "fp32_flat_groups"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
