"""Runs tests/fixtures/scripts/hf_trainer_job.py on 2 ranks (one on a GPU) the way users start a Trainer script.

From a temporary folder holding the script, a tiny pretrained Llama and the DeepSpeed configs:
`zerotrain launch --num_gpus 2 hf_trainer_job.py ...` (the usual way),
`zerotrain run torchrun --nproc_per_node 2 hf_trainer_job.py ...`, and, for the reference,
plain `torchrun` with `--use_cpu` and no DeepSpeed: the Trainer's own DDP.
Commands are found in the venv's bin/ (first on PATH), as after `source .venv/bin/activate`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from conftest import FIXTURES, device_env, user_env, zerotrain_script
from free_ports import free_port

JOB_SCRIPT = FIXTURES / "scripts" / "hf_trainer_job.py"
CONFIGS = FIXTURES / "configs" / "hf"
RANKS = 2
"""Ranks of a CPU job; a GPU job has one (the GPU check's machine has one GPU)."""
STEPS = 8

COMMON_ARGS = (
    "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",  # 2 ranks: 16 a step
    "--max_steps", str(STEPS), "--learning_rate", "1e-3", "--lr_scheduler_type", "linear", "--warmup_steps", "2",
    "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
    "--seed", "0", "--data_seed", "0", "--dataloader_drop_last",
)
"""TrainingArguments every run shares (a later flag on the command line wins)."""


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )


def save_tiny_llama(directory: Path) -> Path:
    """The 'pretrained' model every run fine-tunes: the same weights for DDP and every ZeRO stage."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    return directory


def job_module():
    """hf_trainer_job.py as a module: its datasets and prompt, for references computed here."""
    import importlib.util

    if "hf_trainer_job" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hf_trainer_job", JOB_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["hf_trainer_job"]


@dataclass
class TrainerRun:
    """One finished job: rank 0's JSON results, its --output_dir, and the process (stdout/stderr)."""

    result: dict
    output_dir: Path
    process: subprocess.CompletedProcess

    @property
    def losses(self) -> list[float]:
        return self.result["losses"]


class TrainerJobs:
    """Starts the job script in `workdir`; `run(name, ...)` runs once per name and caches the result,
    so tests of one module share runs (one DDP reference for every parity test)."""

    def __init__(self, workdir: Path, device: str = "cpu") -> None:
        self.cwd = workdir
        self.device = device
        self.ranks = 1 if device == "gpu" else RANKS
        shutil.copy(JOB_SCRIPT, workdir / JOB_SCRIPT.name)
        for config in CONFIGS.glob("*.json"):
            shutil.copy(config, workdir / config.name)
        self.model_dir = save_tiny_llama(workdir / "tiny-llama")
        self._runs: dict[str, TrainerRun] = {}

    def launcher(self, how: str) -> list[str]:
        """The command that starts the script on its ranks: 'launch', 'run-torchrun' or 'torchrun' (no stand-in)."""
        torchrun = ["torchrun", "--nproc_per_node", str(self.ranks), "--master_port", str(free_port())]
        if how == "launch":
            return [zerotrain_script(), "launch", "--num_gpus", str(self.ranks), "--master_port", str(free_port())]
        if how == "run-torchrun":
            return [zerotrain_script(), "run", *torchrun]
        if how == "torchrun":
            return torchrun
        raise ValueError(how)

    def start(self, name: str, *args: str, how: str = "launch", timeout: float = 240) -> TrainerRun:
        """Runs the job now (no cache); the caller checks the exit status."""
        output_dir = self.cwd / name
        result_file = self.cwd / f"{name}.result.json"  # not `{name}.json`: the configs' names
        result_file.unlink(missing_ok=True)
        if self.device == "gpu":  # the reference is the Trainer's own run on the same GPU
            args = tuple(a for a in args if a != "--use_cpu")
        command = [*self.launcher(how), JOB_SCRIPT.name, "--model_dir", self.model_dir.name,
                   "--output_dir", name, "--result", result_file.name, *COMMON_ARGS, *args]
        process = subprocess.run(command, cwd=self.cwd, env=user_env(**device_env(self.device)),
                                 capture_output=True, text=True, timeout=timeout)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        return TrainerRun(result, output_dir, process)

    def run(self, name: str, *args: str, how: str = "launch") -> TrainerRun:
        """Runs the job once per `name` (later calls return the first run); it must succeed."""
        if name not in self._runs:
            done = self.start(name, *args, how=how)
            out, err = done.process.stdout[-3000:], done.process.stderr[-6000:]
            assert done.process.returncode == 0, f"{name}: exit {done.process.returncode}\n{out}\n{err}"
            self._runs[name] = done
        return self._runs[name]
