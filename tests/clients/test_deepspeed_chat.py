"""DeepSpeed-Chat's three steps, unmodified, on zerotrain (the cluster-benchmark guide's workload).

DeepSpeedExamples' `applications/DeepSpeed-Chat` (step 1 SFT, step 2 reward model, step 3 PPO)
runs as its users run it: `deepspeed --num_gpus 2 training/stepN_.../main.py ...`, where
`deepspeed` is `zerotrain launch` under `zerotrain run`, on a tiny OPT built here
(tests/fixtures/scripts/deepspeed_chat_workspace.py) and 2 CPU ranks.

CI cannot run it: DeepSpeed-Chat is not on PyPI (only on GitHub), and it needs transformers < 5
(it imports `no_init_weights` from `transformers.modeling_utils`). `make deepspeed-chat-check
DSCHAT=.../DeepSpeedExamples/applications/DeepSpeed-Chat` builds such a venv and runs this file.

The reference is the same step at `--zero_stage 0` (plain data parallelism, which the parity tests
hold equal to DDP; in fp16 stage 1, see `reference`): DDP itself cannot run DeepSpeed-Chat, whose
scripts call DeepSpeed throughout.
docs/huggingface.md has the figures against DeepSpeed 0.19.8 on this machine.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES, device_env
from free_ports import free_port

DSCHAT_DIR = os.environ.get("ZEROTRAIN_DSCHAT_DIR")
DSCHAT_VENV = os.environ.get("ZEROTRAIN_DSCHAT_VENV")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DSCHAT_DIR and DSCHAT_VENV),
        reason="DeepSpeed-Chat is not on PyPI and needs transformers<5: run `make deepspeed-chat-check "
        "DSCHAT=<DeepSpeedExamples>/applications/DeepSpeed-Chat` (sets ZEROTRAIN_DSCHAT_DIR and ZEROTRAIN_DSCHAT_VENV)",
    ),
]

STEP_SCRIPTS = {1: "training/step1_supervised_finetuning/main.py", 2: "training/step2_reward_model_finetuning/main.py",
                3: "training/step3_rlhf_finetuning/main.py"}
COMMON = ["--data_path", "local/jsonfile", "--data_split", "2,4,4"]
STEP_ARGS = {
    1: ["--model_name_or_path", "{model}", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
        "--max_seq_len", "32", "--learning_rate", "1e-3", "--num_train_epochs", "1", "--print_loss"],
    2: ["--model_name_or_path", "{model}", "--num_padding_at_beginning", "1", "--per_device_train_batch_size", "2",
        "--per_device_eval_batch_size", "2", "--max_seq_len", "32", "--learning_rate", "1e-3", "--num_train_epochs", "1",
        "--eval_interval", "1", "--eval_iters", "2"],
    3: ["--actor_model_name_or_path", "{actor}", "--critic_model_name_or_path", "{critic}", "--num_padding_at_beginning",
        "1", "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2", "--generation_batches",
        "1", "--ppo_epochs", "1", "--max_answer_seq_len", "8", "--max_prompt_seq_len", "32", "--actor_learning_rate",
        "1e-4", "--critic_learning_rate", "1e-4", "--num_train_epochs", "1", "--seed", "1234", "--enable_test_mode",
        "--test_stop_step", "6"],
}
# Against the stage-0 run: bf16 and fp16 rounding differ with the order of the reductions.
RTOL = {"bf16": 2e-2, "fp16": 2e-3}
NUMBER = r"-?\d+\.\d+(?:e[-+]?\d+)?"


def _numbers(step: int, output: str) -> list[float]:
    """What a step prints per step: step 1 each rank's loss, step 2 the evaluated scores of the
    chosen and rejected answers, step 3 the PPO losses and the mean reward of the generations.
    The two ranks' lines may run together (each writes its newline separately): numbers are
    matched exactly, never up to the next space."""
    if step == 1:
        found = re.findall(rf"Step: (\d+), Rank: (\d+), loss = ({NUMBER})", output)
        return [float(loss) for *_, loss in sorted(found, key=lambda g: (int(g[0]), int(g[1])))]  # any rank order
    if step == 2:
        return [float(x) for pair in re.findall(rf"c_scores: ({NUMBER}), r_scores: ({NUMBER}),", output) for x in pair]
    losses = re.findall(rf"Actor Loss: ({NUMBER}) \| Critic Loss: ({NUMBER}) \|", output)
    rewards = re.findall(rf"Average reward score: ({NUMBER}) \|", output)
    return [float(x) for (actor, critic), reward in zip(losses, rewards) for x in (actor, critic, reward)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("deepspeed-chat")
    script = FIXTURES / "scripts" / "deepspeed_chat_workspace.py"
    subprocess.run([str(Path(DSCHAT_VENV) / "bin" / "python"), str(script), DSCHAT_DIR, str(folder)], check=True,
                   capture_output=True, timeout=300)
    return folder


def _run(workspace: Path, step: int, out: Path, stage: int, dtype: str, *extra: str, **paths: str) -> list[float]:
    """Runs one step as its users do; returns its printed numbers."""
    venv_bin = Path(DSCHAT_VENV) / "bin"
    args = [a.format(model=workspace / "tiny-opt", **paths) for a in STEP_ARGS[step]]
    stage_args = (["--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage)] if step == 3
                  else ["--zero_stage", str(stage)])
    command = [str(venv_bin / "zerotrain"), "run", "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
               STEP_SCRIPTS[step], *COMMON, *args, *stage_args, "--dtype", dtype, "--output_dir", str(out),
               "--data_output_path", str(out / "data_files"), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(device_env("cpu"), PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PYTHONPATH=str(workspace / "DeepSpeed-Chat"))
    done = subprocess.run(command, cwd=workspace / "DeepSpeed-Chat", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"step {step}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    numbers = _numbers(step, done.stdout + done.stderr)
    assert numbers, f"step {step} printed no losses:\n{done.stdout[-3000:]}"
    return numbers


def _weights(folder: Path) -> dict:
    import torch

    return torch.load(folder / "pytorch_model.bin", weights_only=True)  # DeepSpeed-Chat's own save


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory):
    """A reference run, each made once: steps 1 and 2 at stage 0 in bf16 and stage 1 in fp16, step 3
    at stage 2 (on the step 1 and 2 models of bf16). Returns (numbers, output folder).

    In fp16, stage 0 divides the gradients by the world size after their sum, as DeepSpeed's
    engine does, and stages 1-3 before it, as DeepSpeed's ZeRO optimizers do: at stage 0 a sum
    overflows where the others' does not, and its skipped steps make another run."""
    runs: dict[tuple[int, str], tuple[list[float], Path]] = {}

    def run(step: int, dtype: str = "bf16"):
        if (step, dtype) not in runs:
            out = tmp_path_factory.mktemp(f"step{step}-reference-{dtype}")
            paths = {"actor": str(run(1)[1]), "critic": str(run(2)[1])} if step == 3 else {}
            stage = 2 if step == 3 else 1 if dtype == "fp16" else 0
            runs[step, dtype] = _run(workspace, step, out, stage, dtype, **paths), out
        return runs[step, dtype]

    return run


def _assert_same_weights(got: dict, want: dict, initial_dir: Path) -> None:
    """The saved model is the trained one: per tensor within what Adam's noise in parameters with
    no gradient to speak of (attention key biases) moves them in 16 steps (lr 1e-3 each), and on
    average 10x closer to the reference than training moved the reference from the start."""
    import torch
    from safetensors.torch import load_file

    assert set(got) <= set(want) and len(got) >= len(want) - 1, "stage 3 leaves out only the tied lm_head"
    initial = load_file(initial_dir / "model.safetensors")
    apart, moved = [], []
    for name, tensor in got.items():
        torch.testing.assert_close(tensor.float(), want[name].float(), rtol=0, atol=2e-2, msg=lambda m: f"{name}: {m}")
        start = initial.get(name.replace("rwtransformer.", "model."))
        if start is not None and start.shape == tensor.shape:
            apart.append((tensor.float() - want[name].float()).abs().mean())
            moved.append((want[name].float() - start.float()).abs().mean())
    assert moved and sum(apart) < 0.1 * sum(moved), f"saved weights {sum(apart):.3g} from the reference, training moved {sum(moved):.3g}"


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("step", [1, 2])
def test_deepspeed_chat_steps_1_and_2_match_the_reference_stage(workspace, reference, tmp_path, step, stage, dtype, offload):
    want, want_out = reference(step, dtype)
    numbers = _run(workspace, step, tmp_path, stage, dtype, *(["--offload"] if offload else []))
    assert numbers == pytest.approx(want, rel=RTOL[dtype], abs=RTOL[dtype])
    # Stage 3 saves through GatheredParameters (save_zero_three_model), the others a state_dict.
    _assert_same_weights(_weights(tmp_path), _weights(want_out), workspace / "tiny-opt")


@pytest.mark.parametrize("stage,hybrid", [(3, False), (3, True), (2, True)], ids=["stage3", "stage3-hybrid", "stage2-hybrid"])
def test_deepspeed_chat_step_3_matches_stage_2(workspace, reference, tmp_path, stage, hybrid):
    want, _ = reference(3)
    paths = {"actor": str(reference(1)[1]), "critic": str(reference(2)[1])}
    numbers = _run(workspace, 3, tmp_path, stage, "bf16", *(["--enable_hybrid_engine"] if hybrid else []), **paths)
    assert len(numbers) == len(want) == 18  # 6 steps: actor loss, critic loss, reward
    assert numbers == pytest.approx(want, rel=RTOL["bf16"], abs=RTOL["bf16"])
