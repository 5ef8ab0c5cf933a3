"""DeepSpeed's `compile` section, where it means torch.compile.

DeepSpeed 0.14 read `{"enabled", "backend", "kwargs"}` here and compiled the engine at initialize;
later releases (0.16 on) keep only DeepCompile's options here (`deepcompile` and its passes:
ZeRO's collectives compiled into the graph) and compile on `engine.compile()`. zerotrain models the
first (`enabled` compiles each layer and the loss at initialize, as `engine.compile(backend,
kwargs)` would) and accepts DeepCompile's keys switched off; `deepcompile: true` is refused
(config/unsupported.py), since zerotrain keeps ZeRO's hooks outside the graph by design.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from zerotrain.config.schema_types import ConfigSection, config_problem

TORCH_COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")
"""torch.compile's keyword arguments besides the model and the backend."""

DEEPCOMPILE_KEYS = frozenset({
    "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
    "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
    "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
    "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes",
})
"""DeepSpeed 0.19's DeepCompile options other than the switch: they act only with `deepcompile: true`."""


class CompileConfig(ConfigSection):
    """torch.compile of the engine (``compile``): each decoder layer and the loss, ZeRO's hooks outside."""

    extra_accepted_keys = tuple(sorted(DEEPCOMPILE_KEYS))

    enabled: bool = False
    """Compile at initialize, as ``engine.compile(backend, kwargs)`` would (DeepSpeed 0.14's key)."""
    backend: str = "inductor"
    """The torch.compile backend: "inductor", "aot_eager", "eager", or any registered name."""
    kwargs: dict[str, Any] = {}
    """Further torch.compile arguments: mode, dynamic, fullgraph, options."""
    deepcompile: bool = False
    """DeepSpeed's DeepCompile (collectives compiled into the graph): not built; must stay false."""
    deepcompile_options: dict[str, Any] = {}
    """DeepCompile's other options as written (they do nothing while deepcompile is false)."""

    @model_validator(mode="before")
    @classmethod
    def _gather_deepcompile_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        options = {key: data.pop(key) for key in list(data) if key in DEEPCOMPILE_KEYS}
        if options:
            data["deepcompile_options"] = {**dict(data.get("deepcompile_options") or {}), **options}
        return data

    @field_validator("kwargs")
    @classmethod
    def _torch_compile_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(TORCH_COMPILE_KWARGS))
        if unknown:
            hint = " (the backend has its own key, compile.backend)" if "backend" in unknown else ""
            raise config_problem(f"{unknown} are not torch.compile arguments{hint}; it takes "
                                 f"{', '.join(TORCH_COMPILE_KWARGS)}")
        return value
