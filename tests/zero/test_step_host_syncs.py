"""forward -> backward -> step reads no tensor on the host, at every stage and precision.

A host read (`.item()`, `bool(t)`, ...) of a device tensor makes the host wait for the GPU; in
every step it leaves the GPU idle while the host catches up. The step keeps the gradient norm,
the clip coefficient and the fp16 overflow flag on the device (the all-reduces are device ops), and
an fp16 step's outcome is settled at the next boundary from a copy made as the step ended. The
probe (tests/host_sync_probe.py) counts the reads on 2 Gloo ranks; on the CPU they are the same
calls a GPU run would make.
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
CLIPS = (0.0, 1.0)


def _probed_steps(world: int) -> dict:
    import torch.distributed as dist

    import zerotrain
    from host_sync_probe import HostReadProbe

    out = {}
    for stage in STAGES:
        for dtype in DTYPES:
            for clip in CLIPS:
                model = make_model()
                config = {**zero_config(stage, world, 1, dtype), "gradient_clipping": clip}
                engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
                micro = engine.train_micro_batch_size_per_gpu()
                rank = dist.get_rank()

                def one_step(step):
                    ids = global_batch(step)[rank * micro : (rank + 1) * micro]
                    engine.backward(engine(input_ids=ids, labels=ids).loss)
                    engine.step()

                one_step(0)  # the optimizer's state is made on its first step
                engine.was_step_applied()  # the user asks: the first step is settled
                with HostReadProbe() as settled:
                    one_step(1)  # nothing pending before it
                with HostReadProbe() as following:
                    one_step(2)  # step 1 pending: settled at this boundary
                out[(stage, dtype, clip)] = {
                    "settled": settled.reads,
                    "following": following.reads,
                    "applied": engine.was_step_applied(),
                    "norm": engine.get_global_grad_norm(),
                }
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def probed():
    return run_on_ranks(2, _probed_steps, 2, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_forward_backward_step_read_nothing_on_the_host(probed, stage, dtype, clip):
    for rank, cases in enumerate(probed):
        case = cases[(stage, dtype, clip)]
        assert case["settled"] == [], f"rank {rank}: host reads in the step: {case['settled']}"
        assert case["applied"] and case["norm"] > 0, case


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_only_the_previous_fp16_outcome_is_read_at_the_next_boundary(probed, stage, dtype):
    # The previous step's record, copied as that step ended: on a GPU a wait on its event only.
    expected = [("tolist", "step_settlement.py:values")] if dtype == "fp16" else []
    for rank, cases in enumerate(probed):
        for clip in CLIPS:
            assert cases[(stage, dtype, clip)]["following"] == expected, (rank, clip)
