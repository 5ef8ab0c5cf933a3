"""Stage 3 details: persistent small parameters, prefetch of the next unit, evaluation and generate()."""

from __future__ import annotations

import torch

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config


def _engine(**zero_extra):
    import zerotrain

    model = make_model()
    cfg = zero_config(3, 2, 1, **zero_extra)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def _train_step(engine, step: int) -> None:
    import torch.distributed as dist

    micro, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    ids = global_batch(step)[rank * micro :][:micro]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _persistence() -> dict:
    from zerotrain.distributed import COMM_COUNTER

    engine = _engine(stage3_param_persistence_threshold=100)  # the norms (32 elements) stay whole
    _train_step(engine, 0)
    COMM_COUNTER.reset()
    _train_step(engine, 1)
    fps = engine.flat_params
    norm = engine.module.model.layers[0].input_layernorm.weight
    proj = engine.module.model.layers[0].self_attn.q_proj.weight
    return {
        "norm_whole": tuple(norm.shape) == (32,),
        "proj_empty": proj.numel() == 0,
        "psi": sum(fp.padded_numel for fp in fps),
        "persistent": sum(fp.padded_numel for fp in fps if fp.persistent),
        "root_sharded": sum(fp.padded_numel for fp in fps if fp.unit is engine.module and not fp.persistent),
        "comm": dict(COMM_COUNTER.elements),
    }


def test_small_parameters_stay_whole_and_cost_one_gather_per_step():
    r = run_on_ranks(2, _persistence)[0]
    assert r["norm_whole"] and r["proj_empty"] and r["persistent"] > 0
    assert r["comm"]["grad"] == r["psi"]
    sharded = r["psi"] - r["persistent"]
    # sharded units: forward + backward gathers (root only in forward); persistent: one gather after the step
    assert r["comm"]["param"] == 2 * sharded - r["root_sharded"] + r["persistent"]


def _prefetch_seen() -> list[bool]:
    engine = _engine()
    layers = engine.module.model.layers
    next_unit = [fp for fp in engine.flat_params if fp.unit is layers[1]]
    seen: list[bool] = []

    def look(module, args):  # runs after zerotrain's own pre-forward hook of layer 0
        seen.append(all(fp.gathered or fp._pending_gather is not None for fp in next_unit))

    layers[0].register_forward_pre_hook(look)
    for step in range(3):
        _train_step(engine, step)
    return seen


def test_next_unit_is_prefetched_once_the_order_is_recorded():
    seen = run_on_ranks(2, _prefetch_seen)[0]
    assert seen == [False, True, True], "first step records the order; later steps prefetch layer 1"


def _evaluate_and_generate() -> dict:
    engine = _engine()
    _train_step(engine, 0)
    engine.eval()
    ids = global_batch(0)[:1, :4]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
        out = engine.module.generate(ids, max_new_tokens=4, do_sample=False)
    freed = all(fp.persistent or not fp.gathered for fp in engine.flat_params)
    return {"logits_shape": tuple(logits.shape), "generated": tuple(out.shape), "freed": freed}


def test_evaluation_and_generate_work_and_leave_parameters_freed():
    for r in run_on_ranks(2, _evaluate_and_generate):
        assert r["logits_shape"] == (1, 4, 64) and r["generated"] == (1, 8) and r["freed"]
