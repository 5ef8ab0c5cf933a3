"""Stage 1 reduce-scatters its gradients during the boundary backward, not in the step.

Structural, not timed: the collectives are counted (`COMM_COUNTER`) at the moments
that matter. Before the boundary, backward accumulates locally and sends nothing;
during the boundary backward, buckets are reduce-scattered while gradients are still
being produced (some are issued before the embedding's gradient, the last one
backward computes, exists); when backward returns nothing is left in flight or
unreduced, so the step sends only the parameter all-gather. A boundary backward
inside `no_sync()` is the exception: the step then reduces what it left.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_on_ranks
from llama_workload import global_batch, make_model, param_groups, zero_config

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`


def _micro_batch(engine, step: int, micro: int) -> torch.Tensor:
    ids = global_batch(step)
    size = engine.train_micro_batch_size_per_gpu()
    start = (micro * engine.world_size + engine.rank) * size
    return ids[start : start + size]


def _engine(stage: int, world: int, gas: int):
    import zerotrain

    model = make_model()
    config = zero_config(stage, world, gas)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _observe(world: int) -> dict:
    from zerotrain.comm.distributed import COMM_COUNTER

    engine = _engine(stage=1, world=world, gas=2)
    psi_padded = sum(fp.padded_numel for fp in engine.flat_params)
    # The embedding's gradient is the last one backward produces: reductions counted by then
    # were issued while backward was still running.
    embed = engine.module.model.embed_tokens.weight
    grad_calls_when_embed_grad_arrived = []
    embed.register_post_accumulate_grad_hook(
        lambda p: grad_calls_when_embed_grad_arrived.append(COMM_COUNTER.calls["grad"])
    )
    out = {"buckets": len(engine.flat_params), "psi_padded": psi_padded}

    COMM_COUNTER.reset()
    chunk = _micro_batch(engine, 0, 0)
    engine.backward(engine(input_ids=chunk, labels=chunk).loss)
    out["before_boundary"] = {"grad_elements": COMM_COUNTER.elements["grad"], "unreduced": engine.reducer.unreduced}
    engine.step()
    out["before_boundary"]["step_grad_elements"] = COMM_COUNTER.elements["grad"]

    COMM_COUNTER.reset()
    chunk = _micro_batch(engine, 0, 1)
    engine.backward(engine(input_ids=chunk, labels=chunk).loss)
    out["boundary_backward"] = {
        "grad_elements": COMM_COUNTER.elements["grad"],
        "grad_calls_when_embed_grad_arrived": grad_calls_when_embed_grad_arrived[-1],
        "in_flight": engine.reducer.in_flight,
        "unreduced": engine.reducer.unreduced,
        "shards_present": all(fp.grad_shard is not None for fp in engine.flat_params),
    }
    COMM_COUNTER.reset()
    engine.step()
    out["step"] = {"grad_elements": COMM_COUNTER.elements["grad"], "param_elements": COMM_COUNTER.elements["param"]}
    out["shards_after_step"] = [fp.grad_shard is None for fp in engine.flat_params]
    return out


def _no_sync_at_the_boundary(world: int) -> dict:
    """Two runs of the same two steps; in one, every backward runs inside no_sync()."""
    from zerotrain.comm.distributed import COMM_COUNTER

    weights, step_grad_elements = {}, {}
    for inside in (False, True):
        engine = _engine(stage=1, world=world, gas=1)
        for step in range(2):
            chunk = _micro_batch(engine, step, 0)
            loss = engine(input_ids=chunk, labels=chunk).loss
            COMM_COUNTER.reset()
            if inside:
                with engine.no_sync():
                    engine.backward(loss)
            else:
                engine.backward(loss)
            backward_grad = COMM_COUNTER.elements["grad"]
            engine.step()
            step_grad_elements[inside] = (backward_grad, COMM_COUNTER.elements["grad"] - backward_grad)
        weights[inside] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    psi_padded = sum(fp.padded_numel for fp in engine.flat_params)
    return {"weights": weights, "grad_elements": step_grad_elements, "psi_padded": psi_padded}


def _two_backwards_before_the_step(world: int) -> dict:
    """Two boundary backwards before one step, against one backward of the summed loss."""
    weights = {}
    for split in (False, True):
        engine = _engine(stage=1, world=world, gas=1)
        chunk = _micro_batch(engine, 0, 0)
        first, second = chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]
        losses = [engine(input_ids=ids, labels=ids).loss for ids in (first, second)]
        if split:
            for loss in losses:
                engine.backward(loss)
        else:
            engine.backward(losses[0] + losses[1])
        engine.step()
        weights[split] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return weights


@pytest.fixture(scope="module")
def observed():
    return run_on_ranks(2, _observe, 2)


def test_stage1_sends_nothing_before_the_accumulation_boundary(observed):
    for r in observed:
        assert r["before_boundary"]["grad_elements"] == 0
        assert r["before_boundary"]["unreduced"], "the local accumulation is pending a reduction"
        assert r["before_boundary"]["step_grad_elements"] == 0, "a non-boundary step reduces nothing"


def test_stage1_reduce_scatters_buckets_while_the_boundary_backward_runs(observed):
    for r in observed:
        b = r["boundary_backward"]
        assert r["buckets"] > 2, "the test model must span several buckets"
        # every bucket but the embedding's own was launched while backward was still running
        assert b["grad_calls_when_embed_grad_arrived"] >= r["buckets"] - 1
        assert b["grad_elements"] == r["psi_padded"], "every bucket reduce-scattered once, by backward"
        assert b["in_flight"] == 0 and not b["unreduced"] and b["shards_present"]


def test_stage1_step_only_gathers_parameters(observed):
    for r in observed:
        assert r["step"]["grad_elements"] == 0, "nothing left for the step to reduce"
        assert r["step"]["param_elements"] == r["psi_padded"]
        assert all(r["shards_after_step"]), "the gradient shard lives only from the boundary backward to the step"


def test_stage1_boundary_backward_inside_no_sync_is_reduced_by_the_step():
    for r in run_on_ranks(2, _no_sync_at_the_boundary, 2):
        psi = r["psi_padded"]
        assert r["grad_elements"][False] == (psi, 0), "normally: reduced in backward"
        assert r["grad_elements"][True] == (0, psi), "inside no_sync: reduced by the step instead"
        for name, w in r["weights"][False].items():
            torch.testing.assert_close(r["weights"][True][name], w, msg=name)


def test_stage1_second_backward_before_the_step_adds_to_the_reduced_shard():
    for r in run_on_ranks(2, _two_backwards_before_the_step, 2):
        for name, w in r[False].items():
            torch.testing.assert_close(r[True][name], w, msg=name)
