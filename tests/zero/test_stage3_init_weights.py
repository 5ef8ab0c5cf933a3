"""A seed gives the same initial model at every ZeRO stage.

`zerotrain train` builds the model normally at stages 0-2 and under `zerotrain.zero.Init`
at stage 3, where each unit is materialized (and initialized) only when it is sharded.
Both start from `torch.manual_seed(training.seed)`; the stage-3 weights, gathered whole,
must be the stage-0 weights bit for bit, so a run's step-0 evaluation and its whole
trajectory do not depend on the stage.
"""

from __future__ import annotations

import torch

from conftest import run_on_ranks


def _initial_weights(stage: int, tied: bool) -> dict[str, torch.Tensor]:
    """The trainer's model set-up (seed, tokenizer, model, engine) at `stage`, weights gathered whole."""
    import zerotrain
    from zerotrain.distributed import init_distributed
    from zerotrain.train.config import load_train_config
    from zerotrain.train.data import load_tokenizer
    from zerotrain.train.model import build_model, decay_groups
    from zerotrain.train.zero_fill import build_engine_config
    from zerotrain.zero import GatheredParameters

    launch = init_distributed()
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
    engine_cfg, _ = build_engine_config(cfg, model=model, world_size=launch.world_size, device_type="cpu",
                                        total_steps=10)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=decay_groups(model, 0.01), config=engine_cfg)
    with GatheredParameters(list(engine.module.parameters())):
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {"deferred": built_deferred, "weights": weights}


def _assert_same_initial_model(tied: bool) -> None:
    stage0 = run_on_ranks(2, _initial_weights, 0, tied)
    stage3 = run_on_ranks(2, _initial_weights, 3, tied)
    assert stage3[0]["deferred"] and not stage0[0]["deferred"], "stage 3 must build under zero.Init"
    reference = stage0[0]["weights"]
    assert len(reference) > 5
    for rank in range(2):
        got = stage3[rank]["weights"]
        assert sorted(got) == sorted(reference)
        different = [name for name in reference if not torch.equal(got[name], reference[name])]
        assert not different, f"rank {rank}: stage-3 initial weights differ from stage 0 in {different}"


def test_stage3_starts_from_the_stage0_weights_bit_for_bit():
    _assert_same_initial_model(tied=False)  # the default `zerotrain train` model


def test_stage3_starts_from_the_stage0_weights_with_tied_embeddings():
    _assert_same_initial_model(tied=True)
