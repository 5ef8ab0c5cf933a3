"""Stage 3 details: persistent small parameters, prefetch, reuse, the live limit, evaluation and generate()."""

from __future__ import annotations

import pytest
import torch

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


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
    from zerotrain.comm.distributed import COMM_COUNTER

    # the norms (32 elements) stay whole; no reuse, so backward gathers every layer unit again
    engine = _engine(stage3_param_persistence_threshold=100, stage3_max_reuse_distance=0)
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


# --- reuse (stage3_max_reuse_distance) and the live limit (stage3_max_live_parameters) -------------


def _sharded_sizes(engine) -> dict:
    """Padded elements of the sharded buckets: per layer unit, the root's, and in all."""
    fps = [fp for fp in engine.flat_params if not fp.persistent]
    layers = [sum(fp.padded_numel for fp in fps if fp.unit is u) for u in engine.module.model.layers]
    root = sum(fp.padded_numel for fp in fps if fp.unit is engine.module)
    return {"layers": layers, "root": root, "psi": sum(fp.padded_numel for fp in fps)}


def _live(engine) -> int:
    return sum(
        fp.padded_numel
        for fp in engine.flat_params
        if not fp.persistent and (fp.gathered or fp._pending_gather is not None)
    )


def _run_with_knobs(**zero_extra) -> dict:
    """Three steps; the third's parameter traffic, and the most elements gathered at once in it."""
    import torch.distributed as dist

    from zerotrain.comm.distributed import COMM_COUNTER
    from zerotrain.zero.flat_param import FlatParam

    engine = _engine(**zero_extra)
    micro, rank = engine.train_micro_batch_size_per_gpu(), dist.get_rank()
    peak = [0]
    plain_gather = FlatParam.gather

    def gather_and_watch(fp, async_op=False):  # live elements only grow at a gather
        plain_gather(fp, async_op)
        peak[0] = max(peak[0], _live(engine))

    losses, live_between_steps = [], []
    FlatParam.gather = gather_and_watch
    try:
        for step in range(3):
            if step == 2:
                COMM_COUNTER.reset()
                peak[0] = _live(engine)
            ids = global_batch(step)[rank * micro :][:micro]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            live_between_steps.append(_live(engine))
    finally:
        FlatParam.gather = plain_gather
    return {"param": COMM_COUNTER.elements["param"], "peak": peak[0], "losses": losses, "between": live_between_steps}


def _reuse_and_live_limit() -> dict:
    sizes = _sharded_sizes(_engine())
    first, last = sizes["layers"]
    # In the trace [layer0, layer1, backward of layer1, backward of layer0], layer 1 is reused at
    # distance 0 and layer 0 after 2x layer 1's elements.
    cases = {
        "no_reuse": {"stage3_max_reuse_distance": 0},
        "reuse_last": {"stage3_max_reuse_distance": 1},
        "reuse_just_short": {"stage3_max_reuse_distance": 2 * last},
        "reuse_both": {"stage3_max_reuse_distance": 2 * last + 1},
        "deepspeed_defaults": {},
        "live_root_and_a_layer": {"stage3_max_live_parameters": sizes["root"] + max(first, last)},
        "live_zero": {"stage3_max_live_parameters": 0},
    }
    return {"sizes": sizes, **{name: _run_with_knobs(**knobs) for name, knobs in cases.items()}}


@pytest.fixture(scope="module")
def reuse_runs():
    return run_on_ranks(2, _reuse_and_live_limit)[0]


def test_units_reused_within_the_distance_are_not_gathered_again_in_backward(reuse_runs):
    r, sizes = reuse_runs, reuse_runs["sizes"]
    first, last = sizes["layers"]
    no_reuse = 2 * sizes["psi"] - sizes["root"]  # test_memory_and_comm's 3Ψ, less the gradients
    assert r["no_reuse"]["param"] == no_reuse
    assert r["reuse_last"]["param"] == no_reuse - last  # only the last layer waits for its backward
    assert r["reuse_just_short"]["param"] == no_reuse - last  # layer 0's distance is not below the limit
    assert r["reuse_both"]["param"] == no_reuse - last - first
    assert r["deepspeed_defaults"]["param"] == sizes["psi"], "1e9: every unit is gathered once per step"
    for name in ("reuse_last", "reuse_just_short", "reuse_both", "deepspeed_defaults"):
        assert r[name]["losses"] == r["no_reuse"]["losses"], name


def test_live_parameters_stay_within_the_limit(reuse_runs):
    r, sizes = reuse_runs, reuse_runs["sizes"]
    needed_now = sizes["root"] + max(sizes["layers"])  # the root wraps the forward, plus one layer
    # DeepSpeed's defaults hold the whole model at the end of forward (prefetched, then kept)
    assert r["deepspeed_defaults"]["peak"] == sizes["psi"] > needed_now
    for name, limit in (("live_root_and_a_layer", needed_now), ("live_zero", 0)):
        assert r[name]["peak"] <= max(limit, needed_now), name
        assert r[name]["losses"] == r["no_reuse"]["losses"], name
    # within the limit the last layer is still kept for its backward (layer 0 is evicted for it)...
    assert r["live_root_and_a_layer"]["param"] == 2 * sizes["psi"] - sizes["root"] - sizes["layers"][-1]
    # ...while with no room at all nothing is kept
    assert r["live_zero"]["param"] == 2 * sizes["psi"] - sizes["root"]


def test_between_steps_only_shards_remain_whatever_the_knobs(reuse_runs):
    for name, run in reuse_runs.items():
        if name != "sizes":
            assert run["between"] == [0, 0, 0], name


def _hidden_states_through_an_inner_module():
    """What DeepSpeed-Chat's `reward_model.forward_value` does: call a submodule, not the root."""
    import zerotrain

    model = make_model()
    engine = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=zero_config(3, 2, 1))[0]
    ids = global_batch(0)
    with torch.no_grad():
        inner = engine.module.model(input_ids=ids).last_hidden_state  # embeddings and final norm: the root unit's
        whole = engine(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    return inner, whole


def test_a_call_that_skips_the_roots_forward_still_gathers_the_roots_parameters():
    reference = make_model().model(input_ids=global_batch(0)).last_hidden_state.detach()
    for inner, whole in run_on_ranks(2, _hidden_states_through_an_inner_module):
        assert torch.allclose(inner, reference, atol=1e-6) and torch.allclose(whole, reference, atol=1e-6)


def _generate_with_the_hybrid_engine_section():
    import logging

    import zerotrain

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerotrain").addHandler(handler)
    model = make_model()
    config = {**zero_config(3, 2, 1), "hybrid_engine": {"enabled": True, "max_out_tokens": 64}}
    engine = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)[0]
    prompt = global_batch(0)[:2, :4]
    with torch.no_grad():
        out = engine.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out, [r.getMessage() for r in records if "hybrid_engine" in r.getMessage()]


def test_hybrid_engine_section_is_accepted_said_once_and_generates_on_gathered_weights():
    # DeepSpeed-Chat's step 3 with --enable_hybrid_engine (DeepSpeed falls back to generate() too).
    reference = make_model().generate(global_batch(0)[:2, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    for out, said in run_on_ranks(2, _generate_with_the_hybrid_engine_section):
        assert torch.equal(out, reference)
        assert len(said) == 1
