"""A seed gives the same initial model at every ZeRO stage.

`zerotrain train` builds the model normally at stages 0-2 and under `zerotrain.zero.Init`
at stage 3, where each unit is materialized (and initialized) only when it is sharded.
Both start from `torch.manual_seed(training.seed)`; the stage-3 weights, gathered whole,
must be the stage-0 weights bit for bit, so a run's step-0 evaluation and its whole
trajectory do not depend on the stage.
"""

from __future__ import annotations

import pytest

import torch
from torch import nn

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _initial_weights(stage: int, tied: bool) -> dict:
    """The trainer's model set-up (seed, tokenizer, model, engine) at `stage`, weights gathered whole."""
    import zerotrain
    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.data import load_tokenizer
    from zerotrain.train.model import build_model, decay_groups
    from zerotrain.train.zero_fill import build_engine_config
    from zerotrain.zero import GatheredParameters

    overrides = ["--zero.zero_optimization.stage", str(stage),
                 # every parameter sharded, none kept whole for being small
                 "--zero.zero_optimization.stage3_param_persistence_threshold", "0"]
    if tied:
        overrides += ["--model.config_overrides.tie_word_embeddings", "true"]
    cfg = load_train_config(None, overrides)
    torch.manual_seed(cfg.training.seed)  # as the trainer does, before the tokenizer and the model
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.path)
    zero = cfg.zero_dict()
    model = build_model(cfg.model, tokenizer, zero_init=zero if stage == 3 else None)
    built_deferred = all(p.is_meta for p in model.parameters())
    engine_cfg, _ = build_engine_config(cfg, model=model, world_size=2, device_type="cpu", total_steps=10)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=decay_groups(model, 0.01), config=engine_cfg)
    with GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {"deferred": built_deferred, "weights": weights}


def _both_stages(tied: bool) -> dict:
    from zerotrain.comm.distributed import init_distributed

    init_distributed()
    return {stage: _initial_weights(stage, tied) for stage in (0, 3)}


def _assert_same_initial_model(tied: bool) -> None:
    for rank, result in enumerate(run_on_ranks(2, _both_stages, tied)):
        stage0, stage3 = result[0], result[3]
        assert stage3["deferred"] and not stage0["deferred"], "stage 3 must build under zero.Init"
        reference, got = stage0["weights"], stage3["weights"]
        assert len(reference) > 5 and sorted(got) == sorted(reference)
        different = [name for name in reference if not torch.equal(got[name], reference[name])]
        assert not different, f"rank {rank}: stage-3 initial weights differ from stage 0 in {different}"


def test_stage3_starts_from_the_stage0_weights_bit_for_bit():
    _assert_same_initial_model(tied=False)  # the default `zerotrain train` model


def test_stage3_starts_from_the_stage0_weights_with_tied_embeddings():
    _assert_same_initial_model(tied=True)


class _Gain(nn.Module):
    """A module whose initializer draws a data-dependent amount (trunc_normal_ rejects and redraws)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim, dim))
        self.offset = nn.Parameter(torch.zeros(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.scale, std=0.5)
        nn.init.normal_(self.offset)


def _torch_model() -> nn.Module:
    torch.manual_seed(7)  # inside the context too: the journal follows a reseed
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), _Gain(32), nn.Embedding(10, 32), nn.Linear(32, 4))


def test_torch_modules_under_init_match_an_eager_build_bit_for_bit():
    from zerotrain.zero import Init
    from zerotrain.zero.stage import StagePlan, build_flat_params

    torch.manual_seed(0)
    eager = _torch_model()
    torch.manual_seed(0)
    with Init():
        deferred = _torch_model()
    assert all(p.is_meta for p in deferred.parameters())
    trainable = [p for p in deferred.parameters() if p.requires_grad]
    build_flat_params(deferred, [trainable], StagePlan(0), 10**9, torch.float32)  # as initialize does, one rank
    for (name, want), (_, got) in zip(eager.state_dict().items(), deferred.state_dict().items()):
        assert torch.equal(got, want), name


def test_after_a_build_under_init_the_generator_is_where_an_eager_build_leaves_it():
    # DeepSpeed-Chat adds its reward model's value head after from_pretrained, and Hugging Face's
    # resize_token_embeddings builds a new embedding under Init and then draws its values: what
    # is drawn after a build must be what is drawn after an eager one (DeepSpeed's zero.Init
    # initializes each parameter for real before partitioning it), or stage 3 trains another model.
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.zero import Init

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    after = {}
    for name, enabled in (("eager", False), ("init", True)):
        torch.manual_seed(0)
        with Init(enabled=enabled):
            _torch_model()
            torch.randn(5, device="meta" if enabled else "cpu")  # a random op outside any initializer
            model = LlamaForCausalLM(config)
        # Hugging Face's ZeRO-3 resize builds the new embedding on the old one's device: meta here.
        nn.Embedding(48, 32, device=model.model.embed_tokens.weight.device)
        after[name] = (nn.Linear(32, 1).weight.detach().clone(), torch.rand(4))
    assert torch.equal(after["init"][0], after["eager"][0]) and torch.equal(after["init"][1], after["eager"][1])
