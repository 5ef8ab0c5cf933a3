"""`zerotrain init`: accelerate config's questions, answered with estimates, writing configs that load."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
import yaml

from zerotrain.planning.config_wizard import Wizard, WizardError, run_questions
from zerotrain.planning.planner import make_plan
from zerotrain.planning.rung_memory import GIB, Hardware
from zerotrain.planning.wizard_questions import LocalGpus, local_gpus

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 256}
OVERRIDES = [t for k, v in TINY.items() for t in ("--config-override", f"{k}={v}")]


def _meta():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))


def _rates(gpu_memory: int, gpus_per_node: int, **speed):
    """The speeds `zerotrain plan` would assume for these flags (the wizard takes the same)."""
    from types import SimpleNamespace

    from zerotrain.planning.speed_args import rates_from_args

    args = {"gpu": None, "intra_node": None, "inter_node": None, "compute": None, "comm": None, **speed}
    return rates_from_args(SimpleNamespace(gpu_memory=gpu_memory, **args), gpus_per_node)[0]


def _session(lines: list[str], gpus: LocalGpus = LocalGpus(), **flags) -> tuple[Wizard, str]:
    out = io.StringIO()  # a machine without GPUs unless `gpus` says otherwise, whatever runs the test
    wizard = Wizard(flags, inp=io.StringIO("".join(f"{x}\n" for x in lines)), out=out, gpus=gpus)
    run_questions(wizard, _meta(), "llama")
    return wizard, out.getvalue()


def test_defaults_are_the_plans_choice_and_each_stage_shows_its_estimate():
    # 1 GiB of the GPU is the reserve: 3 MiB are left, so the plan has to walk down the ladder
    wizard, text = _session(["1", "2", "1027MiB", "", "128", "16"])  # the rest: defaults
    plan = make_plan(_meta(), Hardware(2, gpu_memory=1027 * 2**20), 128, 16, rates=_rates(1027 * 2**20, 2))
    assert plan.rejected and plan.choice is not None
    a = wizard.answers
    assert a["rung"] == plan.choice.rung and a["micro_batch"] == plan.choice.micro_batch
    assert a["gradient_accumulation_steps"] == plan.accumulation
    assert re.search(r"^ +stage 0 +stage 1 +stage 2 +stage 3$", text, re.M)  # a column per stage
    fits = next(line for line in text.splitlines() if line.startswith("  fits  "))
    assert "no" in fits.split()[1:] and "yes" in fits.split()[1:]
    assert "within 3.0 MiB of each 1.00 GiB GPU" in text and f"recommended: {plan.choice.rung.name}" in text


def test_the_recommendation_is_the_fastest_fitting_rung_as_zerotrain_plan_picks_it():
    """On 8 GPUs of 24 GiB a 1.1B Llama fits at stage 0 with one sample per GPU: the first rung of the ladder
    that fits. Stage 1 fits two samples and the step-time model predicts it faster: `zerotrain plan` takes
    it, and so must the wizard's defaults."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes))
    hardware = Hardware(8, gpu_memory=24 * 2**30)
    first_fit = make_plan(model, hardware, 2048, 64).choice
    fastest = make_plan(model, hardware, 2048, 64, rates=_rates(24 * 2**30, 8)).choice
    assert (first_fit.rung.stage, first_fit.micro_batch) == (0, 1) and (fastest.rung.stage, fastest.micro_batch) == (1, 2)
    wizard = Wizard({"num_machines": "1", "gpus_per_machine": "8", "gpu_memory": "24GiB", "seq_len": "2048",
                     "global_batch": "64", "mixed_precision": "bf16"}, inp=io.StringIO(""), out=io.StringIO(),
                    assume_defaults=True)
    run_questions(wizard, model, "llama")
    assert wizard.answers["rung"] == fastest.rung and wizard.answers["micro_batch"] == fastest.micro_batch


def test_a_wrong_answer_is_asked_again_with_its_reason():
    wizard, text = _session(["1", "two", "2", "80GiB", "", "128", "15", "16", "", "7", "2"])
    assert "  'two': not a whole number; accepted answers: a whole number, 1 or more" in text
    assert "'15': not a multiple of the 2 GPUs; accepted answers: a multiple of 2 (the GPUs)" in text
    assert "'7': not one of the choices; accepted answers: one of 0, 1, 2, 3" in text
    assert wizard.answers["zero_stage"] == 2 and wizard.answers["global_batch"] == 16


def test_a_wrong_flag_stops_with_its_reason():
    expected = "--zero-stage '5': not one of the choices; accepted answers: one of 0, 1, 2, 3"
    with pytest.raises(WizardError, match=expected):
        _session([], zero_stage="5", gpu_memory="80GiB")


@pytest.mark.slow
def test_flags_answer_without_input_and_a_config_that_does_not_fit_is_warned(zerotrain_main):
    # In this process: the next test pipes answers into the console script
    flags = ["--num-machines", "1", "--gpus-per-machine", "2", "--gpu-memory", "1GiB", "--seq-len", "64",
             "--global-batch", "4", "--zero-stage", "0", "--yes"]
    done = zerotrain_main("init", "llama", *OVERRIDES, *flags)  # 1 GiB: the 1 GiB reserve leaves nothing
    assert done.returncode == 1, done.stderr
    assert "does not fit: GPU needs" in done.stdout and "Nothing written." in done.stdout
    assert not (zerotrain_main.cwd / "ds_config.json").exists()


@pytest.mark.slow
def test_piped_answers_write_configs_that_zerotrain_and_accelerate_load(zerotrain_cli, zerotrain_main):
    from accelerate.commands.config.config_args import ClusterConfig

    from zerotrain.config import load_config, resolve_config
    from zerotrain.train.config_files import load_train_config

    answers = "1\n2\n2GiB\n\n128\n16\nbf16\n3\ncpu\nnone\nyes\n\n2\n0.5\n"
    done = zerotrain_cli("init", "llama", *OVERRIDES, "--accelerate-config", "acc.yaml", input=answers, check=True)
    assert "Offload the optimizer (none/cpu/nvme)" in done.stdout
    assert "stage 3, optimizer offload none or cpu:" in done.stdout
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
    again = zerotrain_main("init", "llama", *OVERRIDES, "--gpu-memory", "2GiB", "--yes")  # the same folder
    assert again.returncode == 2 and "ds_config.json exists; pass --force" in again.stderr
    assert zerotrain_main("init", "llama", *OVERRIDES, "--gpu-memory", "2GiB", "--yes", "--force").returncode == 0
    assert yaml.safe_load((cwd / "zerotrain.yaml").read_text())["zero"]["zero_optimization"]["stage"] in (0, 1, 2, 3)


def test_memory_shown_in_questions_uses_the_plan_units():
    wizard, text = _session(["1", "1", "80GiB"])
    assert "Memory of one GPU: 80GiB" in text
    assert wizard.answers["gpu_memory"] == 80 * GIB


H100 = LocalGpus(4, 85_031_714_816, "NVIDIA H100 80GB HBM3")


def test_the_gpus_default_to_this_machines():
    wizard, text = _session([], gpus=H100)  # every answer the default
    assert "How many GPUs per machine? [4]: 4" in text
    assert "  this machine's GPU: NVIDIA H100 80GB HBM3, 79.2 GiB\nMemory of one GPU [79.2GiB]: 79.2GiB" in text
    assert wizard.answers["gpus_per_machine"] == 4 and wizard.answers["gpu_memory"] == H100.memory


def test_without_a_gpu_the_memory_question_must_be_answered():
    wizard, text = _session(["1", "1", "", "24GiB"])
    assert "Memory of one GPU: \n  an answer is needed (no default); accepted answers: a memory size" in text
    assert wizard.answers["gpu_memory"] == 24 * GIB
    with pytest.raises(WizardError, match="Memory of one GPU: this question has no default; pass --gpu-memory"):
        _session(["1", "1"])  # input ends: nothing to take


def test_local_gpus_reads_torch_cuda(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_gpus() == LocalGpus()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=H100.memory, name=H100.name))
    assert local_gpus() == H100


@pytest.mark.cuda
def test_local_gpus_on_a_gpu():
    props = torch.cuda.get_device_properties(0)
    assert local_gpus() == LocalGpus(torch.cuda.device_count(), props.total_memory, props.name)
