"""`zerotrain init` as a user runs it: answers typed into a terminal (the installed console script in
a pseudo-terminal, so the terminal echoes them as a real one does) or piped on standard input (the
command in this process, `zerotrain_main`: the same parser and handler, without a start-up that
imports torch and transformers each time; tests/planning/test_config_wizard.py pipes answers into
the console script). The GPUs are hidden: a CPU-only machine, whatever machine runs the test."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import ZerotrainInProcess, user_env, zerotrain_script

pytestmark = pytest.mark.slow  # the console script in a terminal, and a training run: seconds each

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 256}
OVERRIDES = [t for k, v in TINY.items() for t in ("--config-override", f"{k}={v}")]
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
END_OF_INPUT = "\x04"  # Ctrl-D at the start of a line: the terminal ends the input
MODEL_1B = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3.2-1b.json"


def typed(cwd: Path, args: list[str], answers: list[str], timeout: float = 180.0) -> tuple[int, str]:
    """`zerotrain ARGS` in a pseudo-terminal: each answer is typed (then Enter) when a prompt waits for
    one; once they run out, Ctrl-D. Returns the exit code and the screen's text, as the user saw it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([zerotrain_script(), *args], stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                            env=user_env(**CPU_ONLY), start_new_session=True)
    os.close(slave)
    screen, answered, left = b"", 0, list(answers)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                pytest.fail(f"no end after {timeout} s; the screen so far:\n{screen.decode(errors='replace')}")
            # Only a prompt ends a line without a newline, and typed text waits in the terminal until it
            # is read: a short quiet spell is enough (it is waited once per prompt, 30 times in a test).
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the command has exited and closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
                continue
            # Quiet, the last line unfinished and ending in ": ": a prompt waits.
            if len(screen) > answered and screen.rsplit(b"\n", 1)[-1].endswith(b": "):
                os.write(master, (left.pop(0) + "\n" if left else END_OF_INPUT).encode())
                answered = len(screen)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, screen.decode(errors="replace").replace("\r\n", "\n")


@pytest.fixture
def piped(monkeypatch):
    """`piped(cwd, args, answers)`: `zerotrain ARGS` in this process, run from `cwd`, with `answers` on
    standard input. torch.cuda sees no GPU, as CUDA_VISIBLE_DEVICES="" makes it see none in a new process
    (set here, it would come too late for a process that has already asked CUDA)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def run(cwd: Path, args: list[str], answers: str = "") -> subprocess.CompletedProcess:
        return ZerotrainInProcess(cwd, monkeypatch)(*args, input=answers, env=CPU_ONLY)

    return run


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return cwd


def after(screen: str, prompt_line: str) -> str:
    """The line shown right after the first line equal to `prompt_line`."""
    lines = screen.splitlines()
    assert prompt_line in lines, f"no line {prompt_line!r} in:\n{screen}"
    return lines[lines.index(prompt_line) + 1]


def test_an_answer_typed_at_a_terminal_is_shown_once(folder):
    code, screen = typed(folder, ["init", "llama", *OVERRIDES], ["1", "2", "2GiB", "", "64", "8"])
    assert code == 0, screen
    # The terminal echoes what was typed; the wizard printing it again showed "2" on a line of its own.
    assert after(screen, "How many GPUs per machine? [1]: 2").startswith("  no GPU on this machine")
    assert after(screen, "Memory of one GPU: 2GiB") == "CPU memory of one machine (0: do not check) [none]: "
    # Enter took the default without printing it on a line of its own
    assert after(screen, "CPU memory of one machine (0: do not check) [none]: ").startswith("Sequence length")
    assert "Traceback" not in screen and (folder / "zerotrain.yaml").is_file()


WRONG_THEN_RIGHT = [
    ("Model (a Hugging Face directory, config.json, train YAML or architecture) [llama]: ", "This machine", "llama",
     "not a model type transformers knows", "a local Hugging Face model directory or its config.json"),
    ("How many machines? [1]: ", "This machine", "1", "not a whole number", "a whole number, 1 or more"),
    ("How many GPUs per machine? [1]: ", "multi-GPU", "2", "not a whole number", "a whole number, 1 or more"),
    ("Memory of one GPU: ", "80", "2GiB", "no unit; write 80GiB", "a memory size with its unit"),
    ("CPU memory of one machine (0: do not check) [none]: ", "lots", "", "not a size", "0 or none"),
    ("Sequence length (tokens per sample) [256]: ", "long", "64", "not a whole number", "a whole number"),
    ("Global batch (samples per optimizer step, all GPUs) [16]: ", "7", "8", "not a multiple of the 2 GPUs",
     "a multiple of 2 (the GPUs), e.g. 2, 4, 8, 16"),
    ("Mixed precision (no/fp16/bf16) [bf16]: ", "fp8", "bf16", "not one of the choices", "one of no, fp16, bf16"),
    ("ZeRO stage (0-3) [0]: ", "ZeRO-2", "2", "not one of the choices", "one of 0, 1, 2, 3"),
    ("Offload the optimizer (none/cpu/nvme) [none]: ", "gpu", "none", "not one of the choices",
     "one of none, cpu, nvme"),
    ("Gradient checkpointing (no/selective/yes) [no]: ", "maybe", "no", "not no, selective or yes",
     "no, selective or yes"),
    ("Gradient accumulation steps [1]: ", "3", "2", "does not divide the 4 samples", "a divisor of 4: 1, 2, 4"),
    ("Gradient clipping (0: none) [1.0]: ", "lots", "none", "not a number", "a number, 0 or more"),
    ("Learning rate (AdamW, constant) [0.0003]: ", "fast", "1e-3", "not a number", "a number above 0"),
    ("Optimizer steps to train [1000]: ", "many", "5", "not a whole number", "a whole number, 1 or more"),
]


def test_an_unexpected_answer_is_asked_again_with_the_answers_it_accepts(folder):
    answers = [typed_text for _, wrong, right, _, _ in WRONG_THEN_RIGHT for typed_text in (wrong, right)]
    code, screen = typed(folder, ["init", *OVERRIDES], answers)  # the model too is asked
    assert code == 0, screen
    assert "Traceback" not in screen and "invalid literal" not in screen
    for prompt, wrong, right, reason, accepted in WRONG_THEN_RIGHT:
        complaint = after(screen, prompt + wrong)
        assert complaint.startswith(f"  {wrong!r}: ") and reason in complaint, complaint
        assert accepted in complaint.partition("; accepted answers: ")[2], complaint
        assert screen.count(prompt) == 2, f"{prompt!r} not asked again"
    ds = json.loads((folder / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_accumulation_steps"] == 2
    assert "gradient_clipping" not in ds and ds["optimizer"]["params"]["lr"] == 1e-3


def test_without_a_gpu_the_gpu_memory_has_no_default_and_must_be_answered(folder, piped):
    done = piped(folder, ["init", "llama", *OVERRIDES], "1\n1\n\n2GiB\n")
    assert done.returncode == 0, done.stderr
    assert "no GPU on this machine: give the memory of one GPU of the machines you will train on" in done.stdout
    assert "[80.0GiB]" not in done.stdout
    assert "Memory of one GPU: \n  an answer is needed (no default); accepted answers: a memory size" in done.stdout
    assert "Memory of one GPU: 2GiB\n" in done.stdout
    # --yes, or input that ends before the answer: it stops, saying which flag answers it
    for n, (extra, answers) in enumerate(((["--yes"], ""), ([], "1\n1\n"))):
        (folder / str(n)).mkdir()
        stopped = piped(folder / str(n), ["init", "llama", *OVERRIDES, *extra], answers)
        assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
        assert "Memory of one GPU: this question has no default; pass --gpu-memory" in stopped.stderr
        assert not (folder / str(n) / "ds_config.json").exists()


TERMS = ("parameters", "gradients", "master + optimizer", "gradient buckets", "gathered units", "activations",
         "logits peak", "total")


def test_the_memory_table_has_a_line_per_term_and_says_why_stages_2_and_3_need_more(folder, piped):
    # The case: a 1B model at micro-batch 1, where stages 2-3 come out above stage 1
    flags = ["--gpus-per-machine", "2", "--gpu-memory", "80GiB", "--seq-len", "2048", "--global-batch", "2", "--yes"]
    done = piped(folder, ["init", str(MODEL_1B), *flags])
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert re.search(r"^ +stage 0 +stage 1 +stage 2 +stage 3$", text, re.M), text
    size = r"(-|\d+\.\d+ [MG]iB)"
    for term in TERMS:  # its row in the table: one cell per stage
        assert re.search(rf"^  {re.escape(term)} +{size} +{size} +{size} +{size}$", text, re.M), term
    legend = text[text.index("What each line is:"):]
    for term in TERMS:  # and what it is
        assert re.search(rf"^  {re.escape(term)}  +\S", legend, re.M), term
    assert "up to 3 alive of reduce_bucket_size = 500,000,000 elements" in " ".join(legend.split())
    why = " ".join(text[text.index("Stage 2 is estimated"):].split())
    assert re.match(r"Stage 2 is estimated \S+ [MG]iB above stage 1 here: gradient buckets \+", why), why
    assert "outweigh gradients -" in why and "A smaller zero_optimization.reduce_bucket_size" in why


def _optimizer_of_train_yaml(path: Path):
    from zerotrain.train.config_files import load_train_config
    from zerotrain.train.zero_fill import build_engine_config

    cfg = load_train_config(path)
    engine, _ = build_engine_config(cfg, model=None, world_size=2, device_type="cpu",
                                    total_steps=cfg.training.max_steps or 10)
    return engine.optimizer.params, engine.scheduler


def test_both_files_hold_one_learning_rate(folder, piped):
    done = piped(folder, ["init", "llama", *OVERRIDES, "--gpu-memory", "2GiB", "--seq-len", "64", "--yes"])
    assert done.returncode == 0, done.stderr
    ds = json.loads((folder / "ds_config.json").read_text())
    params, schedule = _optimizer_of_train_yaml(folder / "zerotrain.yaml")  # what zerotrain train would run
    assert params["lr"] == ds["optimizer"]["params"]["lr"]  # was 3e-4 against ds_config.json's 1e-4
    assert params == ds["optimizer"]["params"]  # betas, eps and weight decay too
    # ds_config.json has no scheduler (DeepSpeed keeps lr constant): the train YAML says constant too
    assert "scheduler" not in ds and schedule.params["warmup_min_lr"] == schedule.params["warmup_max_lr"]
    from zerotrain.planning.config_wizard import DEFAULT_LR

    assert params["lr"] == DEFAULT_LR == 3e-4  # zerotrain train's own default (training.lr)


def test_the_train_yaml_validates_and_trains_as_written(folder, tmp_path, piped):
    flags = ["--gpu-memory", "2GiB", "--seq-len", "64", "--global-batch", "4", "--mixed-precision", "no",
             "--max-steps", "2", "--yes"]
    done = piped(folder, ["init", "llama", *OVERRIDES, *flags])
    assert done.returncode == 0, done.stderr
    train_yaml = folder / "zerotrain.yaml"
    written = yaml.safe_load(train_yaml.read_text())
    # Complete as written: steps and an absolute run directory (output paths are relative to the working directory)
    run_dir = folder / "runs" / "llama"
    assert written["training"]["max_steps"] == 2 and written["output"]["dir"] == str(run_dir)
    assert "# Run it: zerotrain train zerotrain.yaml" in train_yaml.read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check = piped(elsewhere, ["config", "check", str(train_yaml)])
    assert check.returncode == 0, check.stderr
    assert "valid zerotrain train config" in check.stdout and f"2 steps, output {run_dir}" in check.stdout
    # And it trains, from another folder, with nothing added: 2 steps of the tiny model on 2 CPU processes
    run = subprocess.run([zerotrain_script(), "train", str(train_yaml)], cwd=elsewhere, env=user_env(**CPU_ONLY),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "lr 0.0003" in run.stdout and (run_dir / "metrics.csv").is_file()
