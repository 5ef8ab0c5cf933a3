"""The Hugging Face Trainer with a DeepSpeed config runs unchanged on zerotrain's stand-in.

A user's Trainer script (tests/fixtures/scripts/hf_trainer_job.py) and DeepSpeed configs as
the transformers docs write them ("auto" everywhere, tests/fixtures/configs/hf/) are started
with `zerotrain launch` (or `zerotrain run torchrun`) on 2 Gloo ranks, where no DeepSpeed is
installed; the runs started the same way share one launch, trained one after another: two launches
for the module, as each rank's start-up costs more than a run. In fp32
each ZeRO stage must train exactly as the Trainer's own DDP does on the same data: same loss at
every step, resumable from its checkpoints, and `save_model` must write weights
`from_pretrained` loads.

A config's "scheduler" section (WarmupDecayLR) is DeepSpeed's schedule, not HF's: DeepSpeed
writes lr 0 before the first step and advances from iteration 0 after it, so it runs one step
behind HF's "linear" (real DeepSpeed does the same). Those runs are compared with a DDP run of
that schedule ("ddp-warmup-decay"); configs without the section use the Trainer's own.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import on_gpu
from trainer_fixture import STEPS, Runs, TrainerJobs, TrainerRun, job_module

from zerotrain.compat.deepspeed_standin import STANDIN_DIR

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

LOSS_TOLERANCE = 1e-4

# name -> (how it is started, extra job arguments). Each runs at most once per module, in one
# launch with the others started the same way, in this order: a stage-2 run after a stage-3 one
# and the reverse (each loads as its own config says), a resumed run after the one it resumes.
RUNS: Runs = {
    # The Trainer's own DDP (no --deepspeed: the stand-in `zerotrain run` puts on the path is unused),
    # first in its launch, on fresh processes.
    "ddp": ("run-torchrun", ("--use_cpu", "--save_model_to", "ddp/final")),
    # The reference for configs with a scheduler section: DeepSpeed's WarmupDecayLR runs one
    # step behind HF's linear schedule (lr 0 for two steps), in DeepSpeed as in zerotrain.
    "ddp-warmup-decay": ("run-torchrun", ("--use_cpu", "--deepspeed_warmup_decay")),
    "zero1": ("run-torchrun", ("--deepspeed", "zero1.json")),
    # must stop with the Trainer's error: last of its launch, which it ends
    "mismatch": ("run-torchrun", ("--deepspeed", "zero2-micro-batch-3.json")),
    "zero2": ("launch", ("--deepspeed", "zero2.json", "--save_model_to", "zero2/final",
                         "--save_strategy", "steps", "--save_steps", "4")),
    "zero3": ("launch", ("--deepspeed", "zero3.json", "--save_model_to", "zero3/final", "--generate")),
    "zero2-offload": ("launch", ("--deepspeed", "zero2-offload.json")),
    "zero3-optim-sched": ("launch", ("--deepspeed", "zero3-optim-sched.json",
                                     "--save_strategy", "steps", "--save_steps", "4")),
    "zero3-offload": ("launch", ("--deepspeed", "zero3-offload.json")),
    # 2 ranks x 2 x 4 accumulated: the same 16 sequences a step as 2 x 8 x 1
    "zero2-accumulate": ("launch", ("--deepspeed", "zero2.json", "--per_device_train_batch_size", "2",
                                    "--gradient_accumulation_steps", "4")),
    "zero3-accumulate": ("launch", ("--deepspeed", "zero3.json", "--per_device_train_batch_size", "2",
                                    "--gradient_accumulation_steps", "4")),
    # the engine restores the optimizer and a config's scheduler; the Trainer its own scheduler
    "zero3-optim-sched-resumed": ("launch", ("--deepspeed", "zero3-optim-sched.json",
                                             "--resume_from_checkpoint", "zero3-optim-sched/checkpoint-4")),
    "zero2-resumed": ("launch", ("--deepspeed", "zero2.json", "--resume_from_checkpoint", "zero2/checkpoint-4")),
    "zero3-eval-only": ("launch", ("--deepspeed", "zero3.json", "--eval_only")),
}


@pytest.fixture(scope="module", params=["cpu", on_gpu("gpu", "gpu-1process")])
def jobs(request, tmp_path_factory) -> TrainerJobs:
    """2 CPU ranks; on a GPU, one rank, with the Trainer's own single-GPU run as the reference."""
    jobs = TrainerJobs(tmp_path_factory.mktemp("hf-trainer"), device=request.param, runs=RUNS)
    config = json.loads((jobs.cwd / "zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 3  # the command line says --per_device_train_batch_size 8
    (jobs.cwd / "zero2-micro-batch-3.json").write_text(json.dumps(config, indent=2))  # the run "mismatch"
    return jobs


def trained(jobs: TrainerJobs, name: str) -> TrainerRun:
    return jobs.run(name)


def assert_losses_match(actual: list[float], expected: list[float], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} losses, expected {len(expected)}"
    worst = max(abs(a - e) for a, e in zip(actual, expected))
    assert worst <= LOSS_TOLERANCE, (
        f"{what}: losses differ by {worst:.2e}\n  got      {actual}\n  expected {expected}"
    )


def test_no_deepspeed_is_installed_so_only_the_standin_can_answer_import_deepspeed():
    # Look everywhere on sys.path but the stand-in folder (another test may have activated it here).
    elsewhere = [p for p in sys.path if p and Path(p).resolve() != STANDIN_DIR]
    assert importlib.machinery.PathFinder.find_spec("deepspeed", elsewhere) is None, (
        "a real DeepSpeed is installed in this venv: these tests must show the Trainer runs without it"
    )


@pytest.mark.parametrize(("name", "reference"), [
    ("zero1", "ddp"),  # started with `zerotrain run torchrun`; no optimizer/scheduler section
    ("zero2", "ddp"),  # no optimizer/scheduler section: the Trainer's AdamW and linear schedule
    ("zero2-offload", "ddp-warmup-decay"),  # offload_optimizer cpu; AdamW + WarmupDecayLR sections
    ("zero3", "ddp"),
    ("zero3-optim-sched", "ddp-warmup-decay"),  # AdamW + WarmupDecayLR sections
    ("zero3-offload", "ddp"),  # offload_param + offload_optimizer cpu; AdamW section, the Trainer's schedule
])
def test_trainer_with_a_deepspeed_config_trains_like_the_trainers_own_ddp(jobs, name, reference):
    run = trained(jobs, name)
    assert run.result["deepspeed_module"].startswith(str(STANDIN_DIR)), run.result["deepspeed_module"]
    assert run.result["engine_class"] == "zerotrain.runtime.engine.Engine"
    assert run.result["steps"] == list(range(1, STEPS + 1))
    assert run.result["partitioned_at_load"] == name.startswith("zero3")  # from_pretrained under zero.Init
    assert_losses_match(run.losses, trained(jobs, reference).losses, f"{name} vs {reference}")


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_steps_train_like_a_bigger_micro_batch(jobs, stage):
    whole, accumulated = trained(jobs, f"zero{stage}"), trained(jobs, f"zero{stage}-accumulate")
    assert accumulated.result["partitioned_at_load"] == (stage == 3)  # after a run of the other stage
    assert_losses_match(accumulated.losses, whole.losses, "2 x 4 accumulated vs 8 x 1")
    assert_losses_match(accumulated.losses, trained(jobs, "ddp").losses, "2 x 4 accumulated vs DDP 8 x 1")


@pytest.mark.parametrize("name", ["zero3-optim-sched", "zero2"])
def test_resuming_from_a_step_4_checkpoint_reproduces_steps_5_to_8(jobs, name):
    uninterrupted = trained(jobs, name)
    checkpoint = uninterrupted.output_dir / "checkpoint-4"
    assert (checkpoint / "global_step4").is_dir(), sorted(p.name for p in checkpoint.iterdir())
    assert (checkpoint / "latest").read_text().strip() == "global_step4"

    resumed = trained(jobs, f"{name}-resumed")
    later = [(s, loss) for s, loss in zip(resumed.result["steps"], resumed.losses) if s > 4]
    assert [s for s, _ in later] == [5, 6, 7, 8]
    assert_losses_match([loss for _, loss in later], uninterrupted.losses[4:], "resumed steps 5-8")


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_save_model_writes_the_trained_weights_for_from_pretrained(jobs, name):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = trained(jobs, name)
    model, info = AutoModelForCausalLM.from_pretrained(run.output_dir / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = model.state_dict()
    engine = load_file(run.output_dir / "engine_weights.safetensors")  # gathered from the engine's model
    assert sorted(saved) == sorted(engine)
    for key, tensor in engine.items():
        assert torch.equal(saved[key].float(), tensor), f"{key}: saved weights are not the engine's"
    ddp = AutoModelForCausalLM.from_pretrained(trained(jobs, "ddp").output_dir / "final").state_dict()
    for key, tensor in ddp.items():
        assert torch.allclose(saved[key], tensor, atol=1e-5), f"{key}: trained differently from DDP"


def test_a_config_value_that_contradicts_the_training_arguments_stops_with_the_trainers_error(jobs):
    failed = jobs.attempt("mismatch")  # zero2.json with train_micro_batch_size_per_gpu 3 (the fixture)
    assert failed.launch.started("mismatch"), failed.launch.stderr[-4000:]
    assert failed.launch.returncode != 0
    stderr = failed.launch.stderr_of("mismatch")
    trainers_error = "Please correct the following DeepSpeed config values that mismatch TrainingArguments values"
    assert trainers_error in stderr, stderr[-4000:]
    assert "- ds train_micro_batch_size_per_gpu=3 vs hf per_device_train_batch_size=8" in stderr
    assert not failed.result, "the job must stop before it trains"


def test_stage3_evaluation_without_training_gives_the_plain_models_eval_loss(jobs):
    from transformers import AutoModelForCausalLM

    run = trained(jobs, "zero3-eval-only")
    assert run.result["engine_class"] == "zerotrain.runtime.engine.Engine"
    model = AutoModelForCausalLM.from_pretrained(jobs.model_dir).eval()
    job = job_module()
    eval_set = job.TokenSequences(job.EVAL_SAMPLES, seed=1).ids
    with torch.no_grad():
        plain = model(input_ids=eval_set, labels=eval_set).loss.item()
    assert abs(run.result["eval_loss"] - plain) <= LOSS_TOLERANCE, (run.result["eval_loss"], plain)


def test_stage3_generate_after_training_matches_the_saved_model(jobs):
    from transformers import AutoModelForCausalLM

    run = trained(jobs, "zero3")
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final").eval()
    prompt = job_module().generation_prompt()
    with torch.no_grad():
        plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
    assert run.result["generated"] == plain.tolist()
