"""DeepSpeed's model-state estimators, under DeepSpeed's names, with DeepSpeed's numbers and table.

The guides answer "how much memory does ZeRO need?" with these functions from
`deepspeed.runtime.zero.stage_1_and_2` (ZeRO-2) and `deepspeed.runtime.zero.stage3` (ZeRO-3):
the `_mem_needs` functions return (per-CPU bytes, per-GPU bytes[, largest layer bytes]); the
`_all_cold` ones print a table for a hypothetical model; the `_all_live` ones print it for a
model object. The stand-in package re-exports them, so the guides' snippets run on zerotrain.

The bytes equal DeepSpeed's exactly: the arithmetic keeps DeepSpeed's float operations and
their order (`int()` of a float product can differ in the last byte otherwise). Two things
differ on purpose:

- a model's parameters are counted by identity (`count_parameters`), not by `data_ptr()`:
  DeepSpeed's count collapses every parameter of a meta-device model into one (all point at 0);
- the options column reads `offload_optimizer=cpu ` as in the guides; DeepSpeed on Python 3.11+
  prints `OffloadDeviceEnum.cpu` there (an artifact of that Python's enum formatting).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from zerotrain.planning.model_source import count_parameters

# DeepSpeed pads the device name to 4 characters in the options column ("cpu ").
_CPU = "cpu "
_NONE = "none"
_GIB = 2**30


@dataclass(frozen=True)
class Zero2Option:
    """One row of the ZeRO-2 table: the bytes per CPU (node) and per GPU for one offload choice."""

    offload_optimizer: bool
    cpu_bytes: int
    gpu_bytes: int

    def options_text(self) -> str:
        return f"offload_optimizer={_CPU if self.offload_optimizer else _NONE}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Zero3Option:
    """One row of the ZeRO-3 table: bytes per CPU (node) and per GPU for one offload and zero.Init choice."""

    offload_param: bool
    offload_optimizer: bool
    zero_init: bool
    cpu_bytes: int
    gpu_bytes: int

    def options_text(self) -> str:
        return ", ".join([
            f"offload_param={_CPU if self.offload_param else _NONE}",
            f"offload_optimizer={_CPU if self.offload_optimizer else _NONE}",
            f"zero_init={int(self.zero_init)}",
        ])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- #
# the bytes (DeepSpeed's model: fp16 params and grads, fp32 master + Adam's two states)


def estimate_zero2_model_states_mem_needs(
    total_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) for ZeRO-2's params, gradients and optimizer states."""
    world = num_nodes * num_gpus_per_node
    if cpu_offload:
        # The GPU keeps only the 16-bit params; the CPU holds the 18 bytes/param of the rest,
        # plus a 4-bytes-per-param copy per GPU while the model is loaded.
        gpu = 2 * total_params
        cpu = total_params * max(4 * world, 16) * additional_buffer_factor
    else:
        # 16-bit params whole, and 18 bytes/param (16-bit + fp32 grads, fp32 master, two
        # Adam states) partitioned over every GPU; the CPU only loads the model, once per GPU.
        gpu = 2 * total_params + int(18 * total_params / world)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def estimate_zero3_model_states_mem_needs(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(CPU bytes per node, GPU bytes per GPU, bytes of the largest gathered layer) for ZeRO-3.

    `cpu_offload` offloads the optimizer; `cpu_offload_params` the parameters too (DeepSpeed
    counts it only with `cpu_offload`); `zero_init` builds the model already partitioned, so
    no CPU ever holds a whole copy per GPU.
    """
    world = num_nodes * num_gpus_per_node
    node_share = 1 / num_nodes
    # Every GPU gathers the largest layer whole (fp16 params and grads: 4 bytes/param).
    layer_bytes = 4 * largest_layer_params
    whole_copies = 4 * num_gpus_per_node  # a 4-byte copy per GPU while loading without zero.Init
    if cpu_offload:
        # The CPU holds the optimizer's share of this node (16 bytes/param), and the
        # 16-bit params too (2 more) when they are offloaded.
        per_param = 18 if cpu_offload_params else 16
        if zero_init:  # DeepSpeed's float order, ((P * bytes) * share) * factor, for the same int
            cpu = total_params * per_param * node_share * additional_buffer_factor
        else:
            cpu = total_params * max(whole_copies, per_param * node_share) * additional_buffer_factor
        gpu = layer_bytes if cpu_offload_params else layer_bytes + int(2 * total_params / world)
    else:
        gpu = layer_bytes + int(18 * total_params / world)
        loaded = largest_layer_params if zero_init else total_params
        cpu = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), int(layer_bytes)


# --------------------------------------------------------------------------- #
# the tables


def zero2_options(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                  additional_buffer_factor: float = 1.5) -> list[Zero2Option]:
    """The ZeRO-2 rows in DeepSpeed's order: optimizer offloaded to the CPU, then not."""
    rows = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor)
        rows.append(Zero2Option(offload, cpu, gpu))
    return rows


def zero3_options(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                  num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> list[Zero3Option]:
    """The ZeRO-3 rows in DeepSpeed's order: params+optimizer offloaded, optimizer only, none;
    each with and then without zero.Init."""
    choices = [(True, True), (False, True), (False, False)]  # (offload_param, offload_optimizer)
    rows = []
    for offload_param, offload_optimizer in choices:
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                offload_optimizer, offload_param, zero_init, additional_buffer_factor)
            rows.append(Zero3Option(offload_param, offload_optimizer, zero_init, cpu, gpu))
    return rows


def _header(total_params: float, num_gpus_per_node: int, num_nodes: int, model_line_tail: str = "") -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return (
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params{model_line_tail}.\n"
        "  per CPU  |  per GPU |   Options\n"
    )


def _row(cpu_bytes: int, gpu_bytes: int, options: str) -> str:
    return f" {cpu_bytes / _GIB:7.2f}GB | {gpu_bytes / _GIB:6.2f}GB | {options}\n"


def format_zero2_table(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                       additional_buffer_factor: float = 1.5) -> str:
    """The text `estimate_zero2_model_states_mem_needs_all_cold` prints (newline-terminated)."""
    rows = zero2_options(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    return _header(total_params, num_gpus_per_node, num_nodes) + "".join(
        _row(r.cpu_bytes, r.gpu_bytes, r.options_text()) for r in rows)


def format_zero3_table(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """The text `estimate_zero3_model_states_mem_needs_all_cold` prints (newline-terminated)."""
    rows = zero3_options(total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor)
    tail = f", {int(largest_layer_params / 1e6)}M largest layer params"
    return _header(total_params, num_gpus_per_node, num_nodes, tail) + "".join(
        _row(r.cpu_bytes, r.gpu_bytes, r.options_text()) for r in rows)


# --------------------------------------------------------------------------- #
# the printing functions of the guides


def estimate_zero2_model_states_mem_needs_all_cold(total_params: float, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints the ZeRO-2 memory table for a hypothetical model of `total_params` parameters."""
    print(format_zero2_table(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor), end="")


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints the ZeRO-2 memory table for `model` (real or on the meta device; tied weights once)."""
    total, _ = count_parameters(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: float, largest_layer_params: float,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Prints the ZeRO-3 memory table for a hypothetical model (its total and its largest layer)."""
    print(format_zero3_table(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                             additional_buffer_factor), end="")


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Prints the ZeRO-3 memory table for `model` (real or on the meta device; tied weights once)."""
    total, largest = count_parameters(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)
