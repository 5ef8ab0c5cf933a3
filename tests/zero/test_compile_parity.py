"""Compiled training (`engine.compile()`) matches plain-torch eager training on the same global batch.

One spawn of 2 Gloo ranks trains every case; the reference is one process of plain torch, eager.
Stages 0-3 (and zero.Init, which builds the same layers) compile with inductor, the backend users
get: its C++ kernels are built once for the layer graph and reused from inductor's cache by the
cases after. Offload, whole-layer and selective checkpointing, the chunked loss and LoRA change
the graph, and a fresh inductor build costs 20-50 CPU-s each here: they compile with `aot_eager`
(dynamo's capture and AOTAutograd's forward/backward graphs, run by eager kernels), which is where
ZeRO's hooks, the checkpoint higher-order op and PEFT's layers could go wrong.
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import run_on_ranks
from llama_workload import train_reference, train_zerotrain, zero_config

pytestmark = pytest.mark.slow  # one spawn of 2 ranks, compiling

STEPS = 3  # Adam's first step and two on carried state, clipped and unclipped
TOLERANCE = {  # backend: (rtol, atol) on losses and weights
    "aot_eager": (2e-5, 2e-6),
    "inductor": (1e-4, 1e-5),
}
"""fp32 rounding. aot_eager runs eager kernels: only the ranks' order of summing gradients differs
from one process (~1e-7 relative per op), as in test_parity.py. Inductor also fuses and reorders
fp32 arithmetic (a fused RMSNorm, softmax or SiLU-gate sums in another order); Adam divides by
sqrt(v), so on near-zero gradients that rounding reaches a few 1e-6 of a weight after three steps
(3.5e-6 measured, on one element). Both stay far below what a wrong gradient, a skipped hook or a
layer run twice does: 1e-3 or more after one step at lr 1e-2."""


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the same adapters in every run
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


CPU = {"device": "cpu"}
CASES = {  # name: (stage, backend, zero_optimization extras, train_zerotrain keywords)
    **{f"stage{s}": (s, "inductor", {}, {}) for s in (0, 1, 2, 3)},
    "zero-init": (3, "inductor", {}, {"zero_init": True}),
    "offload": (3, "aot_eager", {"offload_optimizer": CPU, "offload_param": CPU}, {}),
    "checkpointing": (3, "aot_eager", {}, {"checkpointing": True}),
    "selective": (2, "aot_eager", {}, {"checkpointing": "selective"}),
    "chunked-loss": (3, "aot_eager", {}, {"loss_chunk_tokens": 24}),
    "lora": (3, "aot_eager", {}, {"wrap": _lora, "zero_init": True}),
}
REFERENCE_KWARGS = ("checkpointing", "loss_chunk_tokens", "wrap")


def _compiled_cases() -> dict:
    out = {}
    for name, (stage, backend, extra, kwargs) in CASES.items():
        run = train_zerotrain(zero_config(stage, 2, 1, **extra), STEPS, compile={"backend": backend}, **kwargs)
        out[name] = {"losses": run["losses"], "weights": run["weights"], "compiled": run["engine"].is_compiled}
        run["engine"].destroy()
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    ranks = run_on_ranks(2, _compiled_cases, timeout=600)
    for name, run in ranks[0].items():  # each rank's loss is its half of the batch: the step's is their mean
        run["losses"] = [(a + b) / 2 for a, b in zip(run["losses"], ranks[1][name]["losses"])]
    return ranks[0]


@functools.cache
def _reference(**kwargs) -> tuple:
    return train_reference(STEPS, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_training_matches_eager_single_process_training(compiled, name):
    kwargs = {k: v for k, v in CASES[name][3].items() if k in REFERENCE_KWARGS}
    ref_losses, ref_weights = _reference(**kwargs)
    run = compiled[name]
    rtol, atol = TOLERANCE[CASES[name][1]]
    assert run["compiled"] is True
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    assert run["weights"].keys() == ref_weights.keys()
    for n, w in ref_weights.items():
        torch.testing.assert_close(run["weights"][n], w, rtol=rtol, atol=atol, msg=lambda m, n=n: f"{name} {n}: {m}")
