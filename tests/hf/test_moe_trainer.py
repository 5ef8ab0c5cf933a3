"""Mixture-of-experts models through the Hugging Face Trainer with a DeepSpeed config, as LLaMA-Factory
trains them: tiny Mixtral and Qwen3-MoE (transformers' own classes, random init: 2 layers, 4 experts,
top-2, hidden 32), `set_z3_leaf_modules` called on the MoE block class at ZeRO-3, started with
`zerotrain launch` on 2 CPU ranks. Each must train as the Trainer's own DDP does on the same data:
the same loss at every step (the Trainer logs losses to 4 decimals: LOSS_TOLERANCE as in
test_trainer.py). The ranks' tokens choose different experts; transformers 5 stores a block's
experts as one tensor, so an unused expert gets a zero gradient slice (test_moe_routing.py covers
experts as separate modules, unused on a rank).

The DDP references (first, on fresh processes; no --deepspeed: the stand-in on the path is unused)
and all ZeRO runs share one launch (tests/hf/trainer_fixture.py): each rank's start-up costs more
than its runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer import assert_losses_match
from trainer_fixture import STEPS, Runs, TrainerJobs

from zerotrain.compat.deepspeed_standin import STANDIN_DIR

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

MODELS = {"mixtral": "MixtralSparseMoeBlock", "qwen3-moe": "Qwen3MoeSparseMoeBlock"}
"""Model folder tiny-NAME -> its MoE block class, flagged as a ZeRO-3 leaf."""
CONFIGS = ("zero2", "zero3", "zero3-offload")  # zero3-offload: parameters and optimizer on the CPU

RUNS: Runs = {
    **{f"ddp-{m}": ("launch", ("--use_cpu", "--model_dir", f"tiny-{m}")) for m in MODELS},
    **{f"{m}-{c}": ("launch", ("--deepspeed", f"{c}.json", "--model_dir", f"tiny-{m}", "--moe_leaf_class", block))
       for m, block in MODELS.items() for c in CONFIGS},
}


def save_tiny_moe_models(directory: Path) -> None:
    """Tiny random Mixtral and Qwen3-MoE, the 'pretrained' models every run fine-tunes."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shared = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, num_experts_per_tok=2)
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**shared, intermediate_size=64, num_local_experts=4)).save_pretrained(
        directory / "tiny-mixtral")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shared, head_dim=8, moe_intermediate_size=64, num_experts=4,
                                       norm_topk_prob=True)).save_pretrained(directory / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> TrainerJobs:
    jobs = TrainerJobs(tmp_path_factory.mktemp("hf-moe-trainer"), runs=RUNS)
    save_tiny_moe_models(jobs.cwd)
    return jobs


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_moe_model_with_leaf_modules_trains_like_the_trainers_own_ddp(jobs, model, config):
    run = jobs.run(f"{model}-{config}")
    assert run.result["deepspeed_module"].startswith(str(STANDIN_DIR)), run.result["deepspeed_module"]
    assert run.result["engine_class"] == "zerotrain.runtime.engine.Engine"
    assert run.result["steps"] == list(range(1, STEPS + 1))
    # LLaMA-Factory flags the blocks at ZeRO-3 only: one per layer
    assert run.result["z3_leaf_modules"] == (2 if config.startswith("zero3") else 0)
    assert run.result["partitioned_at_load"] == config.startswith("zero3")  # from_pretrained under zero.Init
    assert_losses_match(run.losses, jobs.run(f"ddp-{model}").losses, f"{model} {config} vs DDP")
