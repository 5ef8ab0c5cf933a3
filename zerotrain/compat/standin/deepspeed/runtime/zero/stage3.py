"""`deepspeed.runtime.zero.stage3`: the ZeRO-3 memory estimators the guides call."""

from zerotrain.planning.deepspeed_estimates import (  # noqa: F401
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
