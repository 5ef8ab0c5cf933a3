"""`zerotrain init`: accelerate config's questions, answered with estimates, writing configs that load."""

from __future__ import annotations

import io
import json

import pytest
import torch
import yaml

from zerotrain.planning.config_wizard import Wizard, WizardError, run_questions
from zerotrain.planning.planner import make_plan
from zerotrain.planning.rung_memory import GIB, Hardware

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 256}
OVERRIDES = [t for k, v in TINY.items() for t in ("--config-override", f"{k}={v}")]


def _meta():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))


def _session(lines: list[str], **flags) -> tuple[Wizard, str]:
    out = io.StringIO()
    wizard = Wizard(flags, inp=io.StringIO("".join(f"{x}\n" for x in lines)), out=out)
    run_questions(wizard, _meta(), "llama")
    return wizard, out.getvalue()


def test_defaults_are_the_plans_choice_and_each_stage_shows_its_estimate():
    # 1 GiB of the GPU is the reserve: 3 MiB are left, so the plan has to walk down the ladder
    wizard, text = _session(["1", "2", "1027MB", "", "128", "16"])  # the rest: defaults
    plan = make_plan(_meta(), Hardware(2, gpu_memory=1027 * 2**20), 128, 16)
    assert plan.rejected and plan.choice is not None
    a = wizard.answers
    assert a["rung"] == plan.choice.rung and a["micro_batch"] == plan.choice.micro_batch
    assert a["gradient_accumulation_steps"] == plan.accumulation
    for stage in range(4):
        assert f"  stage {stage}" in text
    assert "of 1.00 GiB per GPU — does not fit" in text and f"recommended: {plan.choice.rung.name}" in text


def test_a_wrong_answer_is_asked_again_with_its_reason():
    wizard, text = _session(["1", "two", "2", "80GB", "", "128", "15", "16", "", "7", "2"])
    assert "gpus per machine 'two'" in text and "try again" in text
    assert "must be a multiple of the 2 GPUs" in text
    assert "answer one of 0, 1, 2, 3" in text
    assert wizard.answers["zero_stage"] == 2 and wizard.answers["global_batch"] == 16


def test_a_wrong_flag_stops_with_its_reason():
    with pytest.raises(WizardError, match="--zero-stage '5': answer one of 0, 1, 2, 3"):
        _session([], zero_stage="5", gpu_memory="80GB")


@pytest.mark.slow
def test_flags_answer_without_input_and_a_config_that_does_not_fit_is_warned(zerotrain_cli):
    flags = ["--num-machines", "1", "--gpus-per-machine", "2", "--gpu-memory", "1GB", "--seq-len", "64",
             "--global-batch", "4", "--zero-stage", "0", "--yes"]
    done = zerotrain_cli("init", "llama", *OVERRIDES, *flags)  # 1 GB: the 1 GiB reserve leaves nothing
    assert done.returncode == 1, done.stderr
    assert "does not fit: GPU needs" in done.stdout and "Nothing written." in done.stdout
    assert not (zerotrain_cli.cwd / "ds_config.json").exists()


@pytest.mark.slow
def test_piped_answers_write_configs_that_zerotrain_and_accelerate_load(zerotrain_cli):
    from accelerate.commands.config.config_args import ClusterConfig

    from zerotrain.config import load_config, resolve_config
    from zerotrain.train.config_files import load_train_config

    answers = "1\n2\n2GB\n\n128\n16\nbf16\n3\ncpu\nnone\nyes\n\n2\n0.5\n"
    done = zerotrain_cli("init", "llama", *OVERRIDES, "--accelerate-config", "acc.yaml", input=answers, check=True)
    assert "Offload the optimizer (none/cpu/nvme)" in done.stdout and "stage 3 + optimizer cpu:" in done.stdout
    cwd = zerotrain_cli.cwd
    ds = json.loads((cwd / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 2 and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_clipping"] == 0.5
    resolve_config(load_config(ds), world_size=2)  # batch sizes agree: 4 x 2 x 2 = 16
    train = load_train_config(cwd / "zerotrain.yaml")
    assert train.training.micro_batch_size == 4 and train.training.grad_clip == 0.5
    assert train.model.config_overrides["hidden_size"] == 64
    acc = ClusterConfig.from_yaml_file(str(cwd / "acc.yaml"))
    assert acc.num_processes == 2 and acc.deepspeed_config["zero3_init_flag"] is True
    again = zerotrain_cli("init", "llama", *OVERRIDES, "--yes")
    assert again.returncode == 2 and "ds_config.json exists; pass --force" in again.stderr
    assert zerotrain_cli("init", "llama", *OVERRIDES, "--yes", "--force").returncode == 0
    assert yaml.safe_load((cwd / "zerotrain.yaml").read_text())["zero"]["zero_optimization"]["stage"] in (0, 1, 2, 3)


def test_memory_shown_in_questions_uses_the_plan_units():
    wizard, text = _session(["1", "1", "80GB"])
    assert "Memory of one GPU [80.0GiB]: 80GB" in text
    assert wizard.answers["gpu_memory"] == 80 * GIB
