"""`zerotrain train --resume-from` a DeepSpeed run's checkpoint: a Llama that a user's own DeepSpeed
script trained 3 steps (tests/fixtures/deepspeed_train, written by real DeepSpeed 0.19.8) continues
under `zerotrain train`, and what does not fit is refused before any rank starts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from zerotrain.train.deepspeed_start import continue_deepspeed_run, name_prefix
from zerotrain.train.run_folder import RunFolderError, resolve_resume

FIXTURE = Path(__file__).parent.parent / "fixtures" / "deepspeed_train"
CHECKPOINT = FIXTURE / "checkpoint"
RUN_YAML = FIXTURE / "llama_run.yaml"


def _zerotrain_lrs(steps: list[int]) -> list[float]:
    """The lr an uninterrupted zerotrain run logs after each of `steps` under llama_run.yaml's schedule."""
    from zerotrain.optim.schedules import WarmupDecayLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-30)
    schedule = WarmupDecayLR(opt, total_num_steps=5, warmup_min_lr=0.0, warmup_max_lr=1e-30, warmup_num_steps=2,
                             warmup_type="linear")
    lrs = {}
    for step in range(1, max(steps) + 1):
        schedule.step()
        lrs[step] = schedule.get_last_lr()[0]
    return [lrs[s] for s in steps]


@pytest.mark.slow
def test_train_resume_from_a_deepspeed_folder_continues_its_weights_step_schedule_and_data(zerotrain_cli, tmp_path):
    saved = json.loads((FIXTURE / "fixture.json").read_text())
    run = tmp_path / "run"
    proc = zerotrain_cli("train", RUN_YAML, "--resume-from", CHECKPOINT, "--output.dir", run,
                         "--data.cache_dir", tmp_path / "cache", check=True)
    assert f"resumed from DeepSpeed's {CHECKPOINT / 'global_step3'} at step 3" in proc.stdout
    assert f"the data continues after {saved['global_samples']} samples" in proc.stdout
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [4, 5]  # DeepSpeed's global_steps went on, not step 0
    # The YAML's schedule at DeepSpeed's step, as an uninterrupted run has it (the CSV keeps 6 digits).
    assert [float(r["lr"]) for r in rows] == pytest.approx(_zerotrain_lrs([4, 5]), rel=1e-5, abs=0)
    from safetensors.torch import load_file

    expected = load_file(FIXTURE / "zero_to_fp32.safetensors")  # DeepSpeed's own consolidation
    exported = load_file(run / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():  # bitwise: an lr of 1e-30 moves no fp32 weight
        assert torch.equal(exported[name].float(), value), name


@pytest.mark.parametrize("override, expected", [
    (["--model.config_overrides.intermediate_size", "48"],
     "parameter 'model.layers.0.mlp.gate_proj.weight' is [32, 16] there but [48, 16] in the model the YAML builds"),
    (["--model.config_overrides.num_hidden_layers", "3"],
     "holds another model than the YAML's `model` section builds: 9 of this model's parameters are not there "
     "(first: ['model.layers.2.input_layernorm.weight'])"),
    (["--training.max_steps", "3"], "the DeepSpeed run is at step 3 and training.max_steps is 3"),
], ids=["another_shape", "another_depth", "no_steps_left"])
def test_resume_from_a_deepspeed_folder_that_does_not_fit_fails_before_any_rank(zerotrain_main, tmp_path, override,
                                                                                  expected):
    run = tmp_path / "run"
    proc = zerotrain_main("train", RUN_YAML, "--resume-from", CHECKPOINT, "--output.dir", run,
                          "--data.cache_dir", tmp_path / "cache", *override)
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and expected in message, proc.stderr
    assert not run.exists()


def test_resume_from_with_resume_is_refused(zerotrain_main):
    proc = zerotrain_main("train", RUN_YAML, "--resume", "--resume-from", CHECKPOINT)
    assert proc.returncode == 2 and "choose one" in proc.stderr


def test_resume_point_of_a_deepspeed_save_folder_or_tag_folder_and_of_a_run_folder(tmp_path):
    tag = CHECKPOINT / "global_step3"
    assert resolve_resume(str(CHECKPOINT), tmp_path).deepspeed == tag
    assert resolve_resume(str(tag), tmp_path).deepspeed == tag
    (tmp_path / "old_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(RunFolderError, match="is a zerotrain run folder: give its checkpoints folder"):
        resolve_resume(str(tmp_path / "old_run"), tmp_path)


def test_name_prefix_finds_a_wrapper_prefix_and_nothing_else():
    ours = {"model.embed_tokens.weight", "lm_head.weight"}
    assert name_prefix(ours, {"module." + n for n in ours}) == "module."
    assert name_prefix(ours, {"_orig_mod." + n for n in ours}) == "_orig_mod."
    assert name_prefix(ours, {"module.model.embed_tokens.weight", "lm_head.weight"}) is None
    assert name_prefix(ours, {"model." + n for n in ours}) == "model."  # the script's own wrapper module


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "model."])
def test_wrapped_names_pass_the_check_before_any_rank_and_each_rank_strips_them(tmp_path, capsys, prefix):
    """The fixture as a script that wrapped its model (DDP, torch.compile, its own module) saved it."""
    from deepspeed_wrapped_copy import wrapped_copy

    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.deepspeed_start import check_deepspeed_start

    point = resolve_resume(str(wrapped_copy(CHECKPOINT, tmp_path / "wrapped", prefix)), tmp_path)
    assert check_deepspeed_start(load_train_config(RUN_YAML), point, None)["global_steps"] == 3
    assert f"every parameter name there starts with {prefix!r}" in capsys.readouterr().out
    engine = _ScheduleOnly(global_steps=3, skipped_steps=0)
    continue_deepspeed_run(engine, _batches(), point, seq_len=4)
    assert engine.strip_prefix == prefix
    continue_deepspeed_run(engine, _batches(), resolve_resume(str(CHECKPOINT), tmp_path), seq_len=4)
    assert engine.strip_prefix is None  # names as saved: nothing stripped


def test_wrapped_names_of_another_model_are_still_refused(tmp_path):
    from deepspeed_wrapped_copy import wrapped_copy

    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.deepspeed_start import check_deepspeed_start

    point = resolve_resume(str(wrapped_copy(CHECKPOINT, tmp_path / "wrapped", "module.")), tmp_path)
    cfg = load_train_config(RUN_YAML, ["--model.config_overrides.num_hidden_layers", "3"])
    with pytest.raises(RunFolderError, match="holds another model than the YAML's `model` section builds"):
        check_deepspeed_start(cfg, point, None)


def _batches():
    from zerotrain.train.data.batches import RankBatches

    return RankBatches(list(range(40)), 2, rank=0, world_size=2)


class _ScheduleOnly:
    """An engine as continue_deepspeed_run sees it after loading: counters and a schedule."""

    def __init__(self, global_steps: int, skipped_steps: int) -> None:
        from types import SimpleNamespace

        from zerotrain.optim.schedules import WarmupLR
        from zerotrain.train.deepspeed_start import deepspeed_names_and_shapes

        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.lr_scheduler = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10,
                                     warmup_type="linear")
        self.global_steps, self.skipped_steps, self.global_samples = global_steps, skipped_steps, 8 * global_steps
        self.flat_params = [SimpleNamespace(names=list(deepspeed_names_and_shapes(CHECKPOINT / "global_step3")[0]))]

    def load_checkpoint(self, path, load_lr_scheduler_states=True, strip_prefix=None):
        assert not load_lr_scheduler_states  # DeepSpeed's may be another scheduler class
        self.strip_prefix = strip_prefix
        return path, {}


def test_the_schedule_takes_one_step_per_optimizer_step_deepspeed_did_not_skip():
    from zerotrain.train.run_folder import ResumePoint

    engine = _ScheduleOnly(global_steps=5, skipped_steps=2)  # fp16 overflows: 3 updates, as many schedule steps
    point = ResumePoint(CHECKPOINT, None, CHECKPOINT / "global_step3")
    _, state = continue_deepspeed_run(engine, _batches(), point, seq_len=4)
    assert engine.lr_scheduler.last_batch_iteration == 2 and state.step == 5 and state.tokens == 40 * 4


def test_skipping_samples_continues_where_drawing_them_would():
    from zerotrain.train.data.batches import RankBatches

    samples = [{"input_ids": torch.tensor([i])} for i in range(41)]  # 10 global steps of 2 x 2 an epoch
    for drawn in (3, 10, 23):  # within the first epoch, at its end, in the third
        walked, skipped = (RankBatches(samples, 2, rank=1, world_size=2, seed=7) for _ in range(2))
        for _ in range(drawn):
            next(walked)
        skipped.skip_samples(drawn * 4 + 3)  # a part of a global step is not trained on: rounded down
        for _ in range(12):  # and on, past the next epoch's start
            assert torch.equal(next(skipped)["input_ids"], next(walked)["input_ids"]), drawn
