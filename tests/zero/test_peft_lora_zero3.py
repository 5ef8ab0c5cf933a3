"""PEFT's LoRA on a model built under `zero.Init` trains as the same LoRA does in one process.

PEFT adds its adapters after the model is built, then moves each to its base layer's device:
for a deferred (stage-3) base layer that device is `meta`, which used to throw the adapters'
values away, so A = B = 0, a gradient norm of 0 and a flat loss (exit 0). The adapters must keep
the values PEFT gave them (rank 0's, as for any layer added after the build), and train.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_on_ranks
from llama_workload import GLOBAL_BATCH, STEPS, global_batch, make_model, param_groups, train_reference, zero_config

pytestmark = pytest.mark.slow  # starts processes: `make test`, not `make check`

LORA_SEED = 1


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(LORA_SEED)  # the same adapters however the base model was built
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def _adapters(named) -> dict[str, torch.Tensor | None]:
    """The LoRA tensors by name; None for one whose values are gone (left on the meta device)."""
    return {n: None if p.is_meta else p.detach().float().cpu().clone() for n, p in named if "lora_" in n}


def _train_lora_at_stage3() -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.zero import GatheredParameters

    init_distributed()
    with zerotrain.zero.Init():
        base = make_model()
    model = _lora(base)
    initial = _adapters(model.named_parameters())
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model),
                                      config=zero_config(3, dist.get_world_size(), 1))
    rank, micro = dist.get_rank(), engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(STEPS):
        ids = global_batch(step)[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with GatheredParameters(list(engine.module.parameters())):
        trained = _adapters(engine.module.named_parameters())
    return {"initial": initial, "losses": losses, "trained": trained}


def test_lora_added_after_a_zero_init_build_keeps_its_values_and_trains_like_one_process():
    ranks = run_on_ranks(2, _train_lora_at_stage3)
    ref_initial = _adapters(_lora(make_model()).named_parameters())
    ref_losses, ref_weights = train_reference(wrap=_lora)
    ref_trained = _adapters(ref_weights.items())
    assert GLOBAL_BATCH % 2 == 0 and len(ref_initial) == 8  # A and B of q_proj and v_proj, 2 layers
    for r in ranks:
        assert r["initial"].keys() == ref_initial.keys()
        for name, value in ref_initial.items():  # PEFT's values, not lost on the meta device
            assert r["initial"][name] is not None, f"{name}: PEFT's values were dropped (moved to meta)"
            torch.testing.assert_close(r["initial"][name], value, rtol=0, atol=0)
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in ranks))]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0], "LoRA should be learning"
    for r in ranks:
        for name, value in ref_trained.items():
            assert r["trained"][name].abs().sum() > 0, f"{name} is all zeros after training"
            err = (r["trained"][name] - value).norm() / value.norm()
            assert err <= 1e-5, f"{name}: relative difference {err:.2e} from the one-process LoRA"
