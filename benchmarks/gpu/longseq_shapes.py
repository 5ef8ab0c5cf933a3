"""The models and the two modes of the long-sequence part: Llama-3.2-1B and Llama-3.1-8B shapes, plain and ALST.

Shapes are the published configs' sizes (random weights, nothing downloaded); dry mode (CPU, CI)
uses two tiny Llamas of the same construction. `max_position_embeddings` is set to the trial's
length: with random weights no rope scaling is needed to measure memory and time.

The modes (what differs between the two searches of a shape):
- plain: ZeRO-3 with Hugging Face gradient checkpointing (non-reentrant), the model's own loss,
  no tiled MLP, no activation offload: how people train long sequences without ALST;
- alst: the same plus tiled MLP, the chunked loss and activation-checkpoint offload.
Both take the optimizer / parameter offload the planner chooses for the mode on this machine's
GPU and host memory (longseq_plan.py), so each runs the ZeRO-3 rung it would be told to run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODES = ("plain", "alst")
MODE_TITLES = {
    "plain": "plain ZeRO-3 (checkpointing; no tiled MLP, chunked loss or activation offload)",
    "alst": "ZeRO-3 + tiled MLP + chunked loss + activation offload (+ checkpointing)",
}
LOSS_CHUNK_TOKENS = 4096  # the planner's suggestion (longest_sequence.SUGGESTED_LOSS_CHUNK)
DRY_LOSS_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class Shape:
    """A Llama's sizes (per the published config.json)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


GPU_SHAPES = (
    Shape("llama-3.2-1b", hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    Shape("llama-3.1-8b", hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, tied=False),
)
# One tiny shape: a dry trial is ~10 s of start-up on a loaded 2-core CI machine, and the part's dry run
# rehearses the steps (planner, search, a trial per mode, report) within ~30 s; --shapes takes the second.
DRY_SHAPES = (
    Shape("tiny", hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=512, tied=True),
    Shape("tiny-untied", hidden=128, intermediate=448, layers=2, heads=4, kv_heads=2, vocab=1024, tied=False),
)


def switches(mode: str, dry: bool) -> dict[str, Any]:
    """The long-sequence switches of `mode`, as zerotrain train's training.* keys name them."""
    on = mode == "alst"
    return {"gradient_checkpointing": True, "tiled_mlp": on, "offload_activations": on,
            "loss_chunk_tokens": (DRY_LOSS_CHUNK_TOKENS if dry else LOSS_CHUNK_TOKENS) if on else None}


def hf_config(shape: Shape | dict, seq: int):
    """The transformers LlamaConfig of `shape` for sequences of `seq` tokens; SDPA attention, no KV cache."""
    from transformers import LlamaConfig

    s = shape if isinstance(shape, dict) else shape.as_dict()
    cfg = LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max(seq, 2048), tie_word_embeddings=s["tied"], use_cache=False,
        rope_parameters={"rope_theta": s["rope_theta"], "rope_type": "default"},
    )
    cfg._attn_implementation = "sdpa"  # set on the config: from_config and __init__ both read it
    return cfg


def base_ds_config() -> dict[str, Any]:
    """The DeepSpeed-format config both modes share; the planner's rung adds the ZeRO section and dtype."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
