"""TRL's trainers on zerotrain, launched as their users launch them, against TRL on plain DDP.

A tiny Llama with a word-level tokenizer is built in the test (nothing is downloaded); the script
is tests/fixtures/scripts/trl_job.py (SFT, DPO or reward model); 2 CPU ranks; `zerotrain launch`
with the DeepSpeed config passed as `TrainingArguments(deepspeed=...)`; the reference is the same
script under `torchrun`, no DeepSpeed. TRL turns bf16 on by default: zerotrain then trains bf16
weights with an fp32 master, DDP fp32 weights under autocast, so losses agree to bf16's precision.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, device_env, user_env, zerotrain_script
from free_ports import free_port

pytest.importorskip("trl", reason="TRL is in the dev extra: pip install -e '.[dev]'")
pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

SCRIPT = FIXTURES / "scripts" / "trl_job.py"
TOLERANCE = {"sft": 1e-3, "dpo": 1e-3, "reward": 5e-3, "grpo": None}
"""Relative, per logged loss. The reward model's pairwise loss is computed from bf16 scores here;
DeepSpeed itself lands 3e-3 from DDP on it. GRPO's loss is near 0: compared to 1e-5 absolute."""
_AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}
CONFIGS = {
    "zero2": {**_AUTO, "zero_optimization": {"stage": 2}},
    "zero3": {**_AUTO, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
}
"""ZeRO-3 with both offloads runs for every trainer in test_trl_trainer_through_accelerate_launch_matches_ddp
(with zero.Init too), so it is not repeated here."""


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


def _losses(command: list[str], cwd: Path, out: Path) -> list[float]:
    """The run's logged losses (and, for GRPO, its rewards after them)."""
    done = subprocess.run(command, cwd=cwd, env=user_env(**device_env("cpu")), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    rewards = out / "rewards.json"
    return json.loads((out / "losses.json").read_text()) + (json.loads(rewards.read_text()) if rewards.exists() else [])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """The model folder, and a function giving a TRL trainer's losses on plain DDP (torchrun, no
    DeepSpeed), each run once."""
    folder = tmp_path_factory.mktemp("trl")
    model_dir = _tiny_llama(folder)
    runs: dict[str, list[float]] = {}

    def losses(trainer: str) -> list[float]:
        if trainer not in runs:
            out = folder / f"ddp-{trainer}"
            command = ["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), str(SCRIPT),
                       trainer, str(model_dir), str(out)]
            runs[trainer] = _losses(command, folder, out)
        return runs[trainer]

    return model_dir, losses


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("trainer", list(TOLERANCE))
def test_trl_trainer_matches_ddp(ddp, tmp_path, trainer, name):
    # Stage 3 used to stop in TRL's lm-head gather (`ds_status` missing on a whole parameter), for
    # DPO's reference model on the dotted keys TRL adds to its config, and for GRPO's generation on
    # `optimizer.parameter_offload` (its rewards come from generations on the gathered policy).
    model_dir, reference_of = ddp
    reference = reference_of(trainer)
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(CONFIGS[name]))
    out = tmp_path / "out"
    losses = _losses([zerotrain_script(), "launch", "--num_gpus", "2", "--master_port", str(free_port()),
                      str(SCRIPT), trainer, str(model_dir), str(out), str(config)], tmp_path, out)
    assert len(losses) == len(reference) == (12 if trainer == "grpo" else 6)
    if trainer == "grpo":
        assert losses == pytest.approx(reference, abs=1e-5)
    else:
        assert losses == pytest.approx(reference, rel=TOLERANCE[trainer])


@pytest.mark.parametrize("trainer", list(TOLERANCE))
def test_trl_trainer_through_accelerate_launch_matches_ddp(ddp, tmp_path, trainer):
    """`accelerate launch` with an `accelerate config` for ZeRO-3 + CPU offload and zero.Init (the
    DeepSpeed plugin supplies the config; the script passes none), under `zerotrain run`."""
    model_dir, reference_of = ddp
    reference = reference_of(trainer)
    cwd = tmp_path / "cwd"
    shutil.copytree(FIXTURES / "configs" / "accelerate", cwd)
    out = tmp_path / "out"
    losses = _losses([zerotrain_script(), "run", "accelerate", "launch", "--config_file", "zero3_offload.yaml",
                      "--main_process_port", str(free_port()), str(SCRIPT), trainer, str(model_dir), str(out)],
                     cwd, out)
    if trainer == "grpo":
        assert losses == pytest.approx(reference, abs=1e-5)
    else:
        assert losses == pytest.approx(reference, rel=TOLERANCE[trainer])
