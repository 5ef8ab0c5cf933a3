"""The size ladder of the size check: Llama models in steps of ~1B parameters, and their config.

Every rung has Llama-2-7B's layer shape (hidden 4096, MLP 11008, 32 heads, no GQA, vocab 32000,
untied embeddings); only the number of layers changes, chosen so that rung n holds about n
billion parameters. One layer shape keeps tokens/s comparable from rung to rung: what grows is
what offload moves (parameters, gradients, optimizer state), not the kernels' shapes.

Dry mode (a CPU machine, CI) uses the same construction scaled down 32x in width and 16x in
vocabulary: rung n holds about n million parameters.

The DeepSpeed-format config of a mode is shared verbatim by zerotrain and DeepSpeed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The two offload modes of the check: name -> (stage, parameters offloaded too).
MODES: dict[str, tuple[int, bool]] = {
    "zero2-offload-opt": (2, False),
    "zero3-offload-opt-param": (3, True),
}
MODE_TITLES = {
    "zero2-offload-opt": "ZeRO-2 + optimizer offload (ZeRO-Offload)",
    "zero3-offload-opt-param": "ZeRO-3 + optimizer and parameter offload",
}


@dataclass(frozen=True)
class Shape:
    """A Llama layer shape; the rungs differ only in `layers`."""

    hidden: int
    intermediate: int
    heads: int
    vocab: int
    unit: float  # parameters per rung step (1e9 on the GPU, 1e6 dry)
    unit_name: str  # "B" or "M"


GPU_SHAPE = Shape(hidden=4096, intermediate=11008, heads=32, vocab=32000, unit=1e9, unit_name="B")
DRY_SHAPE = Shape(hidden=128, intermediate=344, heads=4, vocab=2048, unit=1e6, unit_name="M")


@dataclass(frozen=True)
class Size:
    """One rung of the ladder."""

    index: int  # n: about n units of parameters
    name: str  # "7B"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    params: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_count(shape: Shape, layers: int) -> int:
    """Parameters of the Llama `hf_config` builds: layers, embeddings, LM head, final norm."""
    h, i = shape.hidden, shape.intermediate
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
    return layers * per_layer + 2 * shape.vocab * h + h


def ladder(dry: bool, top: int) -> list[Size]:
    """Rungs 1..top: rung n has the layer count whose parameter count is nearest n units."""
    shape = DRY_SHAPE if dry else GPU_SHAPE
    fixed = param_count(shape, 0)
    per_layer = param_count(shape, 1) - fixed
    sizes = []
    for n in range(1, top + 1):
        layers = max(1, round((n * shape.unit - fixed) / per_layer))
        sizes.append(Size(n, f"{n}{shape.unit_name}", layers, shape.hidden, shape.intermediate, shape.heads,
                          shape.vocab, param_count(shape, layers)))
    return sizes


def hf_config(size: Size | dict, seq: int):
    """The transformers LlamaConfig of a rung (nothing downloaded); sdpa attention, no KV cache."""
    from transformers import LlamaConfig

    s = size if isinstance(size, dict) else size.as_dict()
    cfg = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
        max_position_embeddings=max(seq, 2048), tie_word_embeddings=False, use_cache=False,
    )
    cfg._attn_implementation = "sdpa"  # set on the config: from_config and __init__ both read it
    return cfg


def ds_config(mode: str, micro_batch: int = 1) -> dict[str, Any]:
    """The DeepSpeed-format config of `mode`, used as is by zerotrain and by DeepSpeed.

    `torch_adam: true` makes DeepSpeed build torch.optim.AdamW over its CPU shards instead of
    its DeepSpeedCPUAdam, a C++ op it would JIT-compile (no compiler on the GPU machine); it is
    also what zerotrain builds for "AdamW", so both engines step the same optimizer code.
    Bucket sizes are left at both engines' shared default (5e8 elements).
    """
    stage, offload_param = MODES[mode]
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {
            "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
            "adam_w_mode": True, "torch_adam": True, "foreach": True,
        }},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
