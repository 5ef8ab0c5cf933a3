"""`engine.compile()` compiles each decoder layer whole: no graph breaks, no recompiles after the first step.

Counted with dynamo's own counters (`torch._dynamo.utils.counters`) for a tiny HF Llama and a tiny
GPT-2 at stages 0 and 3, on 2 Gloo ranks, in one spawn. Backend "eager" runs dynamo's capture
(what breaks or recompiles a graph) without inductor's C++ builds, which add nothing to the count.
"""

from __future__ import annotations

import pytest

from conftest import run_on_ranks
from llama_workload import VOCAB, SEQ, global_batch, make_model, param_groups, zero_config

pytestmark = pytest.mark.slow  # one spawn of 2 ranks, 4 compiled cases

CASES = [(arch, stage) for arch in ("llama", "gpt2") for stage in (0, 3)]
STEPS = 3


def _gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)


def _counts() -> dict:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "breaks": dict(counters["graph_break"])}


def _count_cases() -> dict:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import zerotrain

    out = {}
    for arch, stage in CASES:
        torch._dynamo.reset()  # each case compiles from nothing: its own counts
        counters.clear()
        model = make_model() if arch == "llama" else _gpt2()
        engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model),
                                          config=zero_config(stage, 2, 1))
        engine.compile(backend="eager")
        after = []
        for step in range(STEPS):
            ids = global_batch(step)[dist.get_rank() :: 2].to(engine.device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            after.append(_counts())
        out[(arch, stage)] = {"after_each_step": after, "compiled": engine.is_compiled}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def counted() -> dict:
    return run_on_ranks(2, _count_cases)[0]


@pytest.mark.parametrize("arch,stage", CASES)
def test_compiled_layers_have_no_graph_breaks_and_no_recompiles_after_the_first_step(counted, arch, stage):
    first, *later = counted[(arch, stage)]["after_each_step"]
    assert counted[(arch, stage)]["compiled"] is True
    assert first["breaks"] == {}, f"graph breaks: {first['breaks']}"
    # One graph for the layers (they share the code and dynamo lifts their parameters to inputs)
    # and one for the loss: a layer split by a hook, or one graph per layer, would show here.
    assert first["graphs"] == 2, first
    assert all(c == first for c in later), f"compiled again after the first step: {[first, *later]}"
