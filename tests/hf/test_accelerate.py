"""`zerotrain run accelerate launch ...`: Accelerate scripts with DeepSpeed configs, unchanged.

Each config is a YAML as `accelerate config` writes it (tests/fixtures/configs/accelerate/).
The job (tests/fixtures/scripts/accelerate_job.py) trains a tiny Llama on 2 Gloo ranks, with
`save_state` halfway, `get_state_dict` at the end, then `load_state` and a replay of the second
half. Everything must equal one plain-torch process on the global batch.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import FIXTURES, device_env, on_gpu, user_env, zerotrain_script
from free_ports import free_port

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

JOB = FIXTURES / "scripts" / "accelerate_job.py"
CONFIGS = FIXTURES / "configs" / "accelerate"


def _run(args: list[str], cwd: Path, timeout: float = 300, device: str = "cpu") -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=user_env(**device_env(device)), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict, Path]:
    """One process, plain torch (no Accelerate, no stand-in), the whole global batch per step;
    it also saves the initial model every job loads."""
    out = tmp_path_factory.mktemp("reference")
    proc = _run([sys.executable, str(JOB), str(out), str(out / "initial"), "--reference"], cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), load_file(out / "weights.safetensors"), out / "initial"


def _accelerate_launch(tmp_path: Path, config: str, script: Path = JOB, *script_args: str,
                       device: str = "cpu") -> subprocess.CompletedProcess:
    """`accelerate launch` as the config says; on a GPU with one process (`--num_processes 1`)."""
    cwd = tmp_path / "cwd"
    shutil.copytree(CONFIGS, cwd)  # deepspeed_config_file paths are relative to where the user runs
    one_gpu = ["--num_processes", "1"] if device == "gpu" else []
    return _run([zerotrain_script(), "run", "accelerate", "launch", "--config_file", config, *one_gpu, str(script),
                 *script_args], cwd, device=device)


def test_deepspeed_is_not_installed_in_the_test_environment():
    assert importlib.util.find_spec("deepspeed") is None, "these tests must run where only zerotrain provides deepspeed"


@pytest.mark.parametrize("device", ["cpu", on_gpu("gpu", "gpu-1process")])
@pytest.mark.parametrize(
    "config", ["zero1.yaml", "zero2.yaml", "zero3_offload.yaml", "config_file.yaml"],
)
def test_accelerate_config_trains_like_one_process_and_restores_its_state(tmp_path, reference, config, device):
    expected, expected_weights, model_dir = reference
    out = tmp_path / "out"
    proc = _accelerate_launch(tmp_path, config, JOB, str(out), str(model_dir), device=device)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    # Accelerate on a GPU-less machine sees both ranks (not two processes that each think they are alone)
    assert result["num_processes"] == (1 if device == "gpu" else 2)
    assert result["distributed_type"] == "DistributedType.DEEPSPEED"
    assert result["partitioned_at_load"] == (config == "zero3_offload.yaml")  # zero3_init_flag: zero.Init
    # The reference trains on the CPU: a GPU's fp32 kernels sum in another order
    loss_tolerance = 1e-5 if device == "cpu" else 1e-4
    assert result["losses"] == pytest.approx(expected["losses"], abs=loss_tolerance)
    half = len(result["losses"]) // 2
    assert result["replayed"] == pytest.approx(result["losses"][half:], abs=1e-6), "load_state did not restore"
    weights = load_file(out / "weights.safetensors")
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        assert (weights[name] - tensor).abs().max().item() < 10 * loss_tolerance, name


def test_an_auto_value_accelerate_does_not_fill_gets_accelerates_error(tmp_path):
    proc = _accelerate_launch(tmp_path, "betas_auto.yaml", FIXTURES / "scripts" / "accelerate_dummy_optim.py")
    assert proc.returncode != 0
    assert "`optimizer.params.betas` not found in kwargs" in proc.stderr
    assert "prepared" not in proc.stdout


def test_accelerates_multinode_deepspeed_command_is_a_zerotrain_launch(tmp_path, standin_deepspeed):
    """Accelerate starts a multi-machine DeepSpeed job by running `deepspeed FLAGS script`; under
    `zerotrain run` that command is `zerotrain launch`, which must take every flag it is given."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    cwd = tmp_path / "cwd"
    shutil.copytree(CONFIGS, cwd)
    (cwd / "train.py").write_text("")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        # what `accelerate launch` does before it runs the command (accelerate/commands/launch.py)
        args = launch_command_parser().parse_args(["--config_file", "multinode_pdsh.yaml", "train.py", "--lr", "1"])
        args, defaults, _ = _validate_launch_command(args)
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        args.main_process_port = port = free_port()  # Accelerate checks the port is free here
        command, _ = prepare_deepspeed_cmd_env(args)
    assert command[0] == "deepspeed" and "--no_local_rank" in command and "pdsh" in command
    proc = _run([zerotrain_script(), "launch", "--dry_run", *command[1:]], cwd)
    assert proc.returncode == 0, proc.stderr
    assert "2 nodes, 4 ranks" in proc.stderr and f"master worker-1:{port}" in proc.stderr
    jobs = [json.loads(line.removeprefix("# stdin: ")) for line in proc.stdout.splitlines() if line.startswith("# stdin:")]
    assert [(j["host"], j["node_rank"], j["nproc"]) for j in jobs] == [("worker-1", 0, 2), ("worker-2", 1, 2)]
    assert all(j["target_args"] == ["--lr", "1"] and j["local_rank_arg"] is False for j in jobs)
