"""Runs tests/fixtures/scripts/hf_trainer_job.py on 2 ranks (one on a GPU) the way users start a Trainer script.

From a temporary folder holding the script, a tiny pretrained Llama and the DeepSpeed configs:
`zerotrain launch --num_gpus 2 hf_trainer_job.py ...` (the usual way),
`zerotrain run torchrun --nproc_per_node 2 hf_trainer_job.py ...`, and, for the reference,
plain `torchrun` with `--use_cpu` and no DeepSpeed: the Trainer's own DDP.
Commands are found in the venv's bin/ (first on PATH), as after `source .venv/bin/activate`.

Every rank of a launch pays the start-up of torch, transformers and Accelerate (longer than a
run's training), so the named runs started the same way share one launch: the script trains
them one after another in the same processes (`--runs`), each as in a process of its own.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from case_launch import CaseLaunch, launch_cases
from conftest import FIXTURES, zerotrain_script
from free_ports import free_port

JOB_SCRIPT = FIXTURES / "scripts" / "hf_trainer_job.py"
MARKER = "hf_trainer_job"
"""What the script prints on stderr as each run starts: `hf_trainer_job: NAME starts`."""
CONFIGS = FIXTURES / "configs" / "hf"
RANKS = 2
"""Ranks of a CPU job; a GPU job has one (the GPU check's machine has one GPU)."""
STEPS = 8
LAUNCH_TIMEOUT_S, RUN_TIMEOUT_S = 240, 120
"""A launch of one run, and each further run in a launch (seconds; the suite runs beside it on 2 cores)."""

COMMON_ARGS = (
    "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",  # 2 ranks: 16 a step
    "--max_steps", str(STEPS), "--learning_rate", "1e-3", "--lr_scheduler_type", "linear", "--warmup_steps", "2",
    "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
    "--seed", "0", "--data_seed", "0", "--dataloader_drop_last",
)
"""TrainingArguments every run shares (a later flag on the command line wins)."""

Runs = dict[str, tuple[str, tuple[str, ...]]]
"""name -> (how it is started: 'launch', 'run-torchrun' or 'torchrun'; its extra job arguments)."""


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


def check_resumes_follow_their_runs(runs: Runs) -> None:
    """A run resuming from RUN/checkpoint-N must share RUN's launch and come after it in `runs`."""
    for position, (name, (how, args)) in enumerate(runs.items()):
        if "--resume_from_checkpoint" not in args:
            continue
        resumed = Path(args[args.index("--resume_from_checkpoint") + 1]).parts[0]
        earlier = [n for n, (h, _) in list(runs.items())[:position] if h == how]
        if resumed not in earlier:
            raise ValueError(f"run {name!r} resumes from a checkpoint of {resumed!r}: list {resumed!r} before it "
                             f"in RUNS, started the same way ({how!r}), so that its launch writes the checkpoint first")


@dataclass
class TrainerRun:
    """One finished run: rank 0's JSON results, its --output_dir, and and its launch (exit status, stdout, stderr)."""

    result: dict
    output_dir: Path
    launch: CaseLaunch

    @property
    def losses(self) -> list[float]:
        return self.result["losses"]


class TrainerJobs:
    """Starts the job script in `workdir`. `run(name)` runs each of `runs` once: on its first call, every
    run started the same way, in one launch in the order of `runs`, so tests of one module share runs
    (one DDP reference for every parity test) and launches."""

    def __init__(self, workdir: Path, device: str = "cpu", runs: Runs | None = None) -> None:
        self.cwd = workdir
        self.device = device
        self.ranks = 1 if device == "gpu" else RANKS
        self.runs: Runs = dict(runs or {})
        check_resumes_follow_their_runs(self.runs)
        shutil.copy(JOB_SCRIPT, workdir / JOB_SCRIPT.name)
        for config in CONFIGS.glob("*.json"):
            shutil.copy(config, workdir / config.name)
        self.model_dir = save_tiny_llama(workdir / "tiny-llama")
        self._launched: dict[str, CaseLaunch] = {}

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

    def job_args(self, name: str, *args: str) -> list[str]:
        """The script's command line for the run `name`; its result file is removed (a fresh one shows it ran)."""
        result_file = self.result_file(name)
        result_file.unlink(missing_ok=True)
        if self.device == "gpu":  # the reference is the Trainer's own run on the same GPU
            args = tuple(a for a in args if a != "--use_cpu")
        return ["--model_dir", self.model_dir.name, "--output_dir", name, "--result", result_file.name,
                *COMMON_ARGS, *args]

    def result_file(self, name: str) -> Path:
        """Where the run `name` writes its results (rank 0)."""
        return self.cwd / f"{name}.result.json"  # not `{name}.json`: the configs' names

    def finished(self, name: str) -> TrainerRun:
        """The run's results as its launch left them ({} if it wrote none)."""
        result_file = self.result_file(name)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        return TrainerRun(result, self.cwd / name, self._launched[name])

    def _execute(self, how: str, names: list[str], job_args: list[str], timeout: float) -> None:
        launch = launch_cases([*self.launcher(how), JOB_SCRIPT.name, *job_args], self.cwd, self.cwd, MARKER,
                              timeout, device=self.device)
        self._launched.update(dict.fromkeys(names, launch))

    def launch(self, how: str) -> None:
        """Every run started the way `how`, in one launch (the script's --runs), in the order of `runs`."""
        names = [name for name, (h, _) in self.runs.items() if h == how]
        listing = self.cwd / f"{how}.runs.json"
        listing.write_text(json.dumps([{"name": n, "args": self.job_args(n, *self.runs[n][1])} for n in names],
                                      indent=1))
        self._execute(how, names, ["--runs", listing.name], LAUNCH_TIMEOUT_S + RUN_TIMEOUT_S * (len(names) - 1))

    def attempt(self, name: str) -> TrainerRun:
        """The run `name` of `runs` as its launch left it (launched once), ended or not: for a run that
        must fail, listed last of those started the same way."""
        if name not in self._launched:
            self.launch(self.runs[name][0])
        return self.finished(name)

    def run(self, name: str) -> TrainerRun:
        """The run `name` of `runs`, launched once (later calls return the first run); it must have ended
        on every rank: its launch exited 0, or the run after it started (each run ends in a barrier)."""
        how = self.runs[name][0]
        done = self.attempt(name)
        names = [n for n, (h, _) in self.runs.items() if h == how]
        after = names[names.index(name) + 1:]
        launch = done.launch
        ended = launch.returncode == 0 or (after and launch.started(after[0]))
        if not (ended and done.result):
            what = "stopped in it" if launch.started(name) else "stopped before it (an earlier run failed)"
            pytest.fail(f"{name}: its launch (runs {', '.join(names)}) {what}: exit {launch.returncode}\n"
                        f"{launch.stdout[-3000:]}\n{launch.stderr_of(name)}", pytrace=False)
        return done
