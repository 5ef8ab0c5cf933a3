"""ZeRO-3 parameters are empty between uses, whole inside GatheredParameters, and edits persist."""

from __future__ import annotations

import pytest

import torch

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _edit_on_rank0() -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero import GatheredParameters

    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 2, 1))
    weight = engine.module.lm_head.weight
    empty_between_uses = weight.numel() == 0 and tuple(weight.ds_shape) == (64, 32)
    with GatheredParameters([weight], modifier_rank=0):
        whole_inside = tuple(weight.shape) == (64, 32)
        if dist.get_rank() == 0:
            weight.data.zero_()
    ids = global_batch(0)[:2]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits  # a zero head gives zero logits on every rank
    with GatheredParameters([weight]):
        after = weight.detach().clone()
    return {
        "empty_between_uses": empty_between_uses,
        "whole_inside": whole_inside,
        "logits_abs_max": logits.abs().max().item(),
        "weight_abs_max": after.abs().max().item(),
        "freed_after": weight.numel() == 0,
    }


def test_gathered_parameters_with_modifier_rank_changes_the_next_forward_on_every_rank():
    for r in run_on_ranks(2, _edit_on_rank0):
        assert r["empty_between_uses"] and r["whole_inside"] and r["freed_after"]
        assert r["weight_abs_max"] == 0.0 and r["logits_abs_max"] == 0.0


def _save_as_deepspeed_chat(path: str) -> dict:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero import GatheredParameters

    model = make_model()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 2, 1))
    # DeepSpeed-Chat's save_zero_three_model: `.cpu()` of a CPU tensor is the tensor itself, so what
    # it keeps is a view of the gathered buffer, which used to be emptied in place on exit.
    taken = {}
    for name, p in engine.module.named_parameters():
        with GatheredParameters([p]):
            taken[name] = p.data.cpu()
    reference = {}
    for name, p in engine.module.named_parameters():
        with GatheredParameters([p]):
            reference[name] = p.detach().clone()
    loss = engine(input_ids=global_batch(0)[:2], labels=global_batch(0)[:2]).loss
    engine.backward(loss)
    engine.step()  # training goes on, and what was taken does not change with it
    if dist.get_rank() == 0:
        torch.save(taken, path)
    dist.barrier()
    loaded = torch.load(path, weights_only=True)
    return {
        "names": sorted(loaded) == sorted(reference),
        "max_diff": max((loaded[n] - reference[n]).abs().max().item() for n in reference),
        "still_taken": all(torch.equal(taken[n], reference[n]) for n in reference),
        "freed_after": all(p.numel() == 0 for p in engine.module.parameters()),
    }


def test_tensors_taken_inside_gathered_parameters_stay_valid_and_save_loadable(tmp_path):
    path = str(tmp_path / "pytorch_model.bin")
    for r in run_on_ranks(2, _save_as_deepspeed_chat, path):
        assert r["names"] and r["still_taken"] and r["freed_after"]
        assert r["max_diff"] == 0.0
