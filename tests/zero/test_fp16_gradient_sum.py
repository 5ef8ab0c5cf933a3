"""fp16 gradients that fit on every rank never overflow in their sum over the ranks.

DeepSpeed's ZeRO optimizers divide each rank's gradient by the world size before summing it.
zerotrain used to divide after, so at a loss scale where every rank's scaled gradient fits in
fp16 (max 65504) the sum could still overflow: zerotrain skipped fp16 steps DeepSpeed takes
(DeepSpeed-Chat's step 2 ended at loss scale 16384 on zerotrain, 32768 on DeepSpeed).
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

# Loss scale 2**8; each rank's scaled gradient is 40,000 (exact in fp16), their sum 80,000 is not.
SCALE_POWER, PER_RANK_SCALED_GRAD = 8, 40_000.0


def _one_step(stage: int) -> dict:
    import torch
    from torch import nn

    import zerotrain

    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
              "fp16": {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 1},
              "zero_optimization": {"stage": stage}}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.full((1, 1), PER_RANK_SCALED_GRAD / 2**SCALE_POWER, dtype=torch.float16)
    engine.backward(engine(x).float().sum())  # d loss / d weight = x on every rank
    engine.step()
    return {"skipped": engine.skipped_steps, "scale": engine.optimizer.cur_scale,
            "grad_norm": engine.get_global_grad_norm()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_gradients_that_fit_on_each_rank_do_not_overflow_in_the_sum(stage):
    for result in run_on_ranks(2, _one_step, stage):
        assert result["skipped"] == 0 and result["scale"] == 2**SCALE_POWER
        # the average of two equal gradients is that gradient, unscaled
        assert result["grad_norm"] == pytest.approx(PER_RANK_SCALED_GRAD / 2**SCALE_POWER)
