"""The HF Trainer's `--torch_compile` with a DeepSpeed config trains as the Trainer's own eager run.

`TrainingArguments(torch_compile=True)` makes Accelerate call `engine.compile(backend=...,
compile_kwargs=...)` on the engine `deepspeed.initialize` returned (accelerator.py
`_prepare_deepspeed`); zerotrain's compiles each decoder layer's forward in place, ZeRO's hooks
outside. The Trainer script (tests/fixtures/scripts/hf_trainer_job.py) is started as users start
it, `zerotrain launch --num_gpus 2 hf_trainer_job.py --deepspeed zero3.json --torch_compile`,
on 2 Gloo ranks; the reference is the Trainer's own DDP run, eager (`--use_cpu`, no DeepSpeed),
in the same launch. Compiling on a CPU is slow: one run takes the Trainer's default backend
(inductor, as `--torch_compile` alone gives), the other `aot_eager` (dynamo and AOTAutograd's
graphs, run by eager kernels: what could break under ZeRO's hooks, without inductor's C++ builds).
"""

from __future__ import annotations

import pytest

from trainer_fixture import STEPS, Runs, TrainerJobs

pytestmark = pytest.mark.slow  # one launch of 2 ranks, compiling

LOSS_TOLERANCE = 5e-6
"""Absolute, on losses near 4.85 (relative 4e-6): the ranks' fp32 sums in another order than DDP's,
and a compiled layer's fused kernels round differently from eager ones; a wrong gradient or a
missed step moves a loss by 1e-3 or more at lr 1e-3 (test_trainer.py's runs)."""

RUNS: Runs = {
    "ddp": ("launch", ("--use_cpu",)),  # the Trainer's own eager DDP; no --deepspeed: the stand-in is unused
    "zero3-inductor": ("launch", ("--deepspeed", "zero3.json", "--torch_compile")),
    "zero2-aot-eager": ("launch", ("--deepspeed", "zero2.json", "--torch_compile",
                                   "--torch_compile_backend", "aot_eager")),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> TrainerJobs:
    return TrainerJobs(tmp_path_factory.mktemp("hf-trainer-compile"), runs=RUNS)


@pytest.mark.parametrize("name", ["zero3-inductor", "zero2-aot-eager"])
def test_torch_compile_with_deepspeed_config_compiles_the_engine_and_trains_as_eager_ddp(jobs, name):
    compiled, reference = jobs.run(name), jobs.run("ddp")
    assert compiled.result["engine_class"] == "zerotrain.runtime.engine.Engine"
    assert compiled.result["compiled"] is True, "Accelerate did not call engine.compile"
    assert reference.result.get("compiled") is None  # the reference is eager DDP, not an engine
    assert len(compiled.losses) == len(reference.losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(compiled.losses, reference.losses))
    assert worst <= LOSS_TOLERANCE, f"{name}: losses differ by {worst:.2e}\n  {compiled.losses}\n  {reference.losses}"
