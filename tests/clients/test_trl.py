"""TRL's trainers on zerotrain, launched as their users launch them, against TRL on plain DDP.

A tiny Llama with a word-level tokenizer is built in the test (nothing is downloaded); the script
is tests/fixtures/scripts/trl_job.py, a pipeline that trains SFT, DPO, a reward model and GRPO one
after another in the same processes, each as it would train alone. 2 CPU ranks, two launches in
all, each run once for the module (each rank's start-up, torch + transformers + TRL, costs more
than its training): `zerotrain launch` running the pipeline three times in the same processes, first
with no DeepSpeed (the reference: TRL on the Trainer's own DDP), then with a ZeRO-2 and with a ZeRO-3
DeepSpeed config passed as `TrainingArguments(deepspeed=...)`; and `accelerate launch` with an
accelerate config for ZeRO-3 + CPU offload under `zerotrain run`. The tests compare each trainer's
losses, one test per trainer and setup. TRL turns
bf16 on by default: zerotrain then trains bf16 weights with an fp32 master, DDP fp32 weights under
autocast, so losses agree to bf16's precision.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from case_launch import CaseLaunch, launch_cases
from conftest import FIXTURES, zerotrain_script
from free_ports import free_port

pytest.importorskip("trl", reason="TRL is in the dev extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SCRIPT = FIXTURES / "scripts" / "trl_job.py"
TOLERANCE = {"sft": 1e-3, "dpo": 1e-3, "reward": 5e-3, "grpo": None}
"""Relative, per logged loss. The reward model's pairwise loss is computed from bf16 scores here;
DeepSpeed itself lands 3e-3 from DDP on it. GRPO's loss is near 0: compared to 1e-5 absolute."""
TRAINERS = ",".join(TOLERANCE)
"""Every trainer, in one launch: SFT, DPO, reward model, GRPO (the script's order of a pipeline)."""
_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
CONFIGS = {
    "zero2": {**_AUTO, "zero_optimization": {"stage": 2}},
    "zero3": {**_AUTO, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
}
"""ZeRO-3 with both offloads runs for every trainer in test_trl_trainer_through_accelerate_launch_matches_ddp
(with zero.Init too), so it is not repeated here."""
ACCELERATE = "accelerate-zero3-offload"
LAUNCH = "zerotrain-launch"
"""The launch of the DDP reference and of CONFIGS, one after another."""
TIMEOUT_S = 900
"""For one launch of all four trainers three times (a minute or two alone on 2 cores; the suite runs beside it)."""
MARKER = "trl_job"
"""What the script prints on stderr before each trainer: `trl_job: SETUP/TRAINER starts` (`TRAINER` alone under
accelerate launch)."""


def _losses(launch: CaseLaunch, trainer: str) -> list[float]:
    """The trainer's logged losses (and, for GRPO, its rewards after them), from OUT/TRAINER/
    (`trainer`: SETUP/TRAINER when the launch ran several setups)."""
    losses = launch.out / trainer / "losses.json"
    if not losses.exists():
        launch.fail_for(trainer, str(losses))
    rewards = launch.out / trainer / "rewards.json"
    return json.loads(losses.read_text()) + (json.loads(rewards.read_text()) if rewards.exists() else [])


def _tiny_llama(folder: Path) -> Path:
    """A 2-layer Llama (random weights) and a 124-word tokenizer, saved as a user's local model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(120)} | {"<unk>": 120, "<s>": 121, "</s>": 122, "<pad>": 123}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=123, bos_token_id=121, eos_token_id=122)
    model_dir = folder / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("trl"))


@pytest.fixture(scope="module")
def zerotrain_runs(model_dir, tmp_path_factory):
    """A function giving the launch named `name` (LAUNCH: the DDP reference then CONFIGS; or ACCELERATE)
    of every trainer, each launched once for the module."""
    runs: dict[str, CaseLaunch] = {}

    def launched(name: str) -> CaseLaunch:
        if name not in runs:
            folder = tmp_path_factory.mktemp(name)
            out = folder / "out"
            if name == ACCELERATE:
                cwd = folder / "cwd"
                shutil.copytree(FIXTURES / "configs" / "accelerate", cwd)
                command = [zerotrain_script(), "run", "accelerate", "launch", "--config_file", "zero3_offload.yaml",
                           "--main_process_port", str(free_port()), str(SCRIPT), TRAINERS, str(model_dir), str(out)]
            else:
                cwd = folder
                for config, content in CONFIGS.items():
                    (folder / f"{config}.json").write_text(json.dumps(content))
                # the reference first, on fresh processes: then the DeepSpeed setups end them normally
                command = [zerotrain_script(), "launch", "--num_gpus", "2", "--master_port", str(free_port()),
                           str(SCRIPT), TRAINERS, str(model_dir), str(out), "ddp",
                           *(str(folder / f"{config}.json") for config in CONFIGS)]
            runs[name] = launch_cases(command, cwd, out, MARKER, TIMEOUT_S)
        return runs[name]

    return launched


def _ddp(zerotrain_runs, trainer: str) -> list[float]:
    """The trainer's results on plain DDP (no DeepSpeed): the reference."""
    return _losses(zerotrain_runs(LAUNCH), f"ddp/{trainer}")


def _assert_matches_ddp(losses: list[float], reference: list[float], trainer: str) -> None:
    assert len(losses) == len(reference) == (12 if trainer == "grpo" else 6)
    if trainer == "grpo":
        assert losses == pytest.approx(reference, abs=1e-5)
    else:
        assert losses == pytest.approx(reference, rel=TOLERANCE[trainer])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("trainer", list(TOLERANCE))
def test_trl_trainer_matches_ddp(zerotrain_runs, trainer, name):
    # Stage 3 used to stop in TRL's lm-head gather (`ds_status` missing on a whole parameter), for
    # DPO's reference model on the dotted keys TRL adds to its config, and for GRPO's generation on
    # `optimizer.parameter_offload` (its rewards come from generations on the gathered policy).
    _assert_matches_ddp(_losses(zerotrain_runs(LAUNCH), f"{name}/{trainer}"), _ddp(zerotrain_runs, trainer), trainer)


@pytest.mark.parametrize("trainer", list(TOLERANCE))
def test_trl_trainer_through_accelerate_launch_matches_ddp(zerotrain_runs, trainer):
    """`accelerate launch` with an `accelerate config` for ZeRO-3 + CPU offload and zero.Init (the
    DeepSpeed plugin supplies the config; the script passes none), under `zerotrain run`."""
    _assert_matches_ddp(_losses(zerotrain_runs(ACCELERATE), trainer), _ddp(zerotrain_runs, trainer), trainer)


@pytest.mark.parametrize("name", [LAUNCH, ACCELERATE])
def test_trl_pipeline_on_zerotrain_exits_0(zerotrain_runs, name):
    """zerotrain's runs end normally, as DeepSpeed scripts do, after the last trainer (the script
    checks each trainer ran on the DeepSpeed engine, zerotrain's, where its setup names DeepSpeed, on
    DDP where it does not, and raises if one did not)."""
    launch = zerotrain_runs(name)
    assert launch.returncode == 0, (f"`{' '.join(launch.command)}`: exit {launch.returncode}\n"
                                    f"{launch.stdout[-2000:]}\n{launch.stderr[-6000:]}")
