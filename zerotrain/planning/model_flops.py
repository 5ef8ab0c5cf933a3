"""FLOPs of one micro-batch from the architecture, counted as the flops profiler counts them.

The profiler (profiling/step_flops.py) counts with torch's FlopCounterMode: 2 FLOPs per
multiply-add of every matmul, and attention's QK^T and AV over the full s x s square (causal or
not); backward is twice the forward. Here the same sums come from sizes alone, so a plan for a
70B model on 4,096 GPUs costs no forward: the matmuls are every `nn.Linear` (GPT-2's `Conv1D`) of the (meta) model,
the attention term comes from the config. `tests/planning/test_step_time.py` checks both against
the counter on a real forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs of one sample of `seq_len` tokens, split where the step-time model needs it."""

    layer_matmul: float
    """Matmuls of all transformer layers together (the part gradient checkpointing recomputes)."""
    layer_attention: float
    """Attention scores and their use (QK^T, AV) of all layers."""
    head_matmul: float
    """Matmuls outside the layers: the LM head (embedding lookups cost none)."""
    layers: int
    seq_len: int

    @property
    def forward(self) -> float:
        return self.layer_matmul + self.layer_attention + self.head_matmul

    def per_micro_batch(self, micro_batch: int, recompute: bool) -> dict[str, float]:
        """FLOPs of one micro-step: forward, backward (2x) and checkpointing's recompute of the layers."""
        fwd = self.forward * micro_batch
        out = {"forward": fwd, "backward": 2 * fwd, "recompute": 0.0}
        if recompute:
            out["recompute"] = (self.layer_matmul + self.layer_attention) * micro_batch
        return out


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def layer_shape(config) -> tuple[int, int, int, int]:
    """(layers, hidden, attention heads, head dim) from a Hugging Face config (Llama, GPT-2, ...)."""
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    heads = _config_value(config, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        raise ValueError(f"{type(config).__name__}: no layer count, hidden size or head count to count FLOPs by")
    head_dim = _config_value(config, "head_dim", default=None) or hidden // heads
    return int(layers), int(hidden), int(heads), int(head_dim)


def model_flops(model: nn.Module, seq_len: int) -> ModelFlops:
    """The forward FLOPs of one sample of `model` (meta device is fine) at `seq_len` tokens."""
    from zerotrain.zero.units import find_layer_units

    layers, _hidden, heads, head_dim = layer_shape(model.config)
    in_layers: set[int] = set()
    for unit in find_layer_units(model):
        in_layers.update(id(m) for m in unit.modules())
    layer_linear = head_linear = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":  # GPT-2's linear
            if id(module) in in_layers:
                layer_linear += module.weight.numel()
            else:
                head_linear += module.weight.numel()
    attention = layers * 2 * (2 * seq_len * seq_len * heads * head_dim)  # QK^T and AV, full square
    return ModelFlops(2.0 * seq_len * layer_linear, float(attention), 2.0 * seq_len * head_linear, layers, seq_len)
