"""Evaluation under Ulysses: with `disable_in_eval` (DeepSpeed's flag, what Accelerate passes) an
eval-mode engine forward runs the whole, unsplit batch as the plain model does; a training forward
without position_ids is still refused, and so is an eval one when the flag is off.

Tolerance: exact. Eval with the flag runs the same kernel on the same batch as the plain model.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_on_ranks
from ulysses_workload import global_batch, make_model


def _eval_forwards() -> dict:
    import zerotrain
    from zerotrain.comm.distributed import init_distributed
    from zerotrain.sequence import SequenceParallelError, install_ulysses_attention, uninstall_ulysses_attention
    from zerotrain.sequence.groups import initialize_sequence_parallel

    init_distributed()
    ids = global_batch()["input_ids"]
    model = make_model().eval()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    # As Accelerate does: register the attention with disable_in_eval, then initialize with sp.
    wrapper = install_ulysses_attention(model, initialize_sequence_parallel(2).sequence_group, disable_in_eval=True)
    config = {"train_batch_size": 2, "sequence_parallel_size": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)

    def refusal() -> str:
        try:
            with torch.no_grad():
                engine(input_ids=ids)
            return "accepted"
        except SequenceParallelError as error:
            return str(error)

    engine.eval()
    with torch.no_grad():
        evaluated = engine(input_ids=ids).logits
    engine.train()
    training = refusal()
    engine.eval()
    wrapper.disable_in_eval = False
    eval_without_flag = refusal()
    uninstall_ulysses_attention("sdpa")
    engine.destroy()
    return {"reference": reference, "evaluated": evaluated, "training": training, "eval_without_flag": eval_without_flag}


@pytest.mark.slow
def test_eval_with_disable_in_eval_runs_unsplit_and_training_still_needs_positions():
    for rank, got in enumerate(run_on_ranks(2, _eval_forwards, timeout=180)):
        torch.testing.assert_close(got["evaluated"], got["reference"], rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank} eval logits: {m}")
        assert "needs position_ids" in got["training"]
        assert "needs position_ids" in got["eval_without_flag"]
