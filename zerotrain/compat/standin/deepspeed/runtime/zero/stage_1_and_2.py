"""`deepspeed.runtime.zero.stage_1_and_2`: the ZeRO-2 memory estimators the guides call."""

from zerotrain.planning.deepspeed_estimates import (  # noqa: F401
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
