"""What a rank holds and what it sends match the ZeRO paper's accounting.

Memory (bytes a rank holds between steps, measured from the tensors), with Ψ the
trainable elements (padded so each bucket divides by N) and K = 12 for Adam in
mixed precision (fp32 master 4 + exp_avg 4 + exp_avg_sq 4):
    stage 0: 2Ψ + 2Ψ + KΨ        stage 1: 2Ψ + 2Ψ + KΨ/N        stage 2: 2Ψ + (2 + K)Ψ/N
    stage 3: (2 + 2 + K)Ψ/N
In fp32 the master is the parameter itself, so K = 8.
Communication per optimizer step (elements, per rank): 2Ψ at stages 0-2; 3Ψ at stage 3, less
the root unit's re-gather (embeddings and head stay whole from forward through backward),
measured with `stage3_max_reuse_distance: 0` (no unit kept from forward for its backward).
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import global_batch, train_zerotrain, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _measure(world: int) -> dict:
    from zerotrain.comm.distributed import COMM_COUNTER

    out = {}
    for stage in (0, 1, 2, 3):
        for dtype in ("bf16", "fp32"):
            # Stage 3 without reuse (DeepSpeed's default keeps units reused soon, see
            # test_stage3_units.py): every layer unit is gathered again in backward.
            run = train_zerotrain(zero_config(stage, world, 1, dtype, stage3_max_reuse_distance=0), steps=2)
            engine = run["engine"]
            fps = engine.flat_params
            COMM_COUNTER.reset()
            # one more optimizer step, counted
            ids = global_batch(0)
            micro = engine.train_micro_batch_size_per_gpu()
            chunk = ids[engine.rank * micro : (engine.rank + 1) * micro]
            engine.backward(engine(input_ids=chunk, labels=chunk).loss)
            engine.step()
            out[(stage, dtype)] = {
                "bytes": engine.memory_breakdown(),
                "psi": sum(fp.numel for fp in fps),
                "psi_padded": sum(fp.padded_numel for fp in fps),
                "buckets": len(fps),
                "root_padded": sum(fp.padded_numel for fp in fps if fp.unit is engine.module),
                "comm": dict(COMM_COUNTER.elements),
            }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def measured(request):
    world = request.param
    return world, run_on_ranks(world, _measure, world)[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_rank_memory_matches_zero_formula(measured, stage, dtype):
    world, m = measured
    r = m[(stage, dtype)]
    psi, b = r["psi_padded"], r["bytes"]
    assert 0 <= psi - r["psi"] < world * r["buckets"], "padding is less than one element per rank per bucket"
    low = 2 if dtype == "bf16" else 4  # bytes per parameter / gradient element
    shards = world if stage >= 1 else 1
    assert b["params"] == (low * psi if stage <= 2 else low * psi // world)
    grads = low * psi if stage <= 1 else low * psi // world
    assert b["grads"] == grads
    master = 0 if dtype == "fp32" else 4 * psi // shards
    assert b["master"] == master
    assert b["optimizer_state"] == 8 * psi // shards  # Adam: exp_avg + exp_avg_sq in fp32
    k = 12 if dtype == "bf16" else 8
    total = b["params"] + b["grads"] + b["master"] + b["optimizer_state"]
    formula = {
        0: (2 * low) * psi + k * psi,
        1: (2 * low) * psi + k * psi // world,
        2: low * psi + (low + k) * psi // world,
        3: (2 * low + k) * psi // world,
    }
    assert total == formula[stage]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_elements_moved_per_step_are_two_psi(measured, stage):
    _, m = measured
    r = m[(stage, "bf16")]
    moved = r["comm"].get("grad", 0) + r["comm"].get("param", 0)
    assert moved == 2 * r["psi_padded"]
    # the only other traffic is a few scalars (overflow flag, gradient norm)
    assert r["comm"].get("scalar", 0) <= 4


def test_elements_moved_per_step_at_stage_3_are_three_psi_less_the_root_regather(measured):
    _, m = measured
    r = m[(3, "bf16")]
    assert r["comm"]["grad"] == r["psi_padded"]  # one reduce-scatter of every gradient
    # forward gathers every unit, backward gathers every layer unit again
    assert r["comm"]["param"] == 2 * r["psi_padded"] - r["root_padded"]
    assert 0 < r["root_padded"] < r["psi_padded"]
