"""Ulysses sequence parallelism switched on as Hugging Face users do, on zerotrain's `deepspeed` stand-in.

A Trainer script (tests/fixtures/scripts/hf_ulysses_job.py) with Accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=2)` and a ZeRO-2 DeepSpeed config, started with
`zerotrain launch` on 4 CPU ranks (sp 2 x dp 2), must train as the same script at sp = 1 (trained
first in the same launch: the ranks' start-up costs more than both runs): the same
loss and gradient norm at every step (rtol 1e-5: fp32, only the summation order of the attention
and the loss over the shards differs). The group of ranks [2, 3] holds no global rank 0, where
torch's Gloo backward of the Trainer's differentiable all_gather failed until zerotrain's fix
(zerotrain/sequence/gloo_all_to_all_fix.py). sp = 4 (the whole world, key/value heads replicated)
is covered at the engine in tests/sequence/test_ulysses_parity.py; one launch pair here keeps CPU use low.

A TRL SFTTrainer script (tests/fixtures/scripts/trl_ulysses_job.py) under `zerotrain run accelerate
launch`, with an accelerate config for ZeRO-3 whose `parallelism_config` sets sp 2 x dp 2 (as TRL's
ALST guide writes it), must equal its run without that section, to the same rtol.

Accelerate's AutoTP path opens with the stand-in's version (>= 0.16.4): it must stop with zerotrain's
refusal before anything trains.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import user_env, zerotrain_script
from free_ports import free_port

pytestmark = pytest.mark.slow  # every test here starts processes

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "scripts"
RANKS = 4
SP = 2  # sp 2 x dp 2
RTOL = 1e-5


def _launch(tmp: Path, script: str, *args: str, ranks: int = RANKS) -> subprocess.CompletedProcess:
    command = [zerotrain_script(), "launch", "--num_gpus", str(ranks), "--master_port", str(free_port()),
               str(SCRIPTS / script), *args]
    return subprocess.run(command, cwd=tmp, env=user_env(), capture_output=True, text=True, timeout=600)


def _trainer_runs(tmp: Path, *sizes: int) -> list[dict]:
    """The Trainer script's results at each sequence-parallel size, trained in turn in one launch."""
    done = _launch(tmp, "hf_ulysses_job.py", "--sp", ",".join(map(str, sizes)), "--out", str(tmp))
    assert done.returncode == 0, f"sp={sizes} launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [json.loads((tmp / f"sp{sp}.json").read_text()) for sp in sizes]


def test_trainer_with_accelerate_ulysses_sp2_dp2_trains_as_without(tmp_path):
    reference, ulysses = _trainer_runs(tmp_path, 1, SP)
    assert ulysses["sp_world_size"] == SP and ulysses["sdpa_function"] == "UlyssesAttention"
    assert reference["sp_world_size"] == 1
    assert len(ulysses["losses"]) == len(reference["losses"]) == 2
    assert ulysses["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    # clipping at 1.0 acts on this norm: DeepSpeed's sp-times larger gradient would show here
    assert ulysses["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)


_ACCELERATE_ZERO3 = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: {sp}
  gradient_clipping: 1.0
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: 'no'
machine_rank: 0
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""
_SP_SECTION = """parallelism_config:
  parallelism_config_dp_shard_size: {dp}
  parallelism_config_sp_size: {sp}
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
"""


def _trl_run(tmp: Path, sp: int) -> dict:
    config, out = tmp / f"sp{sp}.yaml", tmp / f"trl_sp{sp}.json"
    config.write_text(_ACCELERATE_ZERO3.format(sp=sp) + (_SP_SECTION.format(sp=sp, dp=RANKS // sp) if sp > 1 else ""))
    command = [zerotrain_script(), "run", "accelerate", "launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(SCRIPTS / "trl_ulysses_job.py"), str(out)]
    done = subprocess.run(command, cwd=tmp, env=user_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"TRL sp={sp} launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_trl_sft_with_accelerate_config_ulysses_sp2_dp2_trains_as_without(tmp_path):
    pytest.importorskip("trl", reason="TRL is in the dev extra: pip install -e '.[dev]'")
    reference, ulysses = _trl_run(tmp_path, 1), _trl_run(tmp_path, SP)
    assert (reference["sp_size"], ulysses["sp_size"]) == (1, SP) and ulysses["sdpa_function"] == "UlyssesAttention"
    assert len(ulysses["losses"]) == len(reference["losses"]) == 2
    assert ulysses["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert ulysses["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)


def test_accelerate_autotp_stops_with_zerotrains_refusal_before_training(tmp_path):
    done = _launch(tmp_path, "accelerate_autotp_job.py", ranks=2)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "not built in zerotrain" in output and "tensor_parallel" in output, output[-4000:]
    assert "Deepspeed TP requires deepspeed" not in output
    assert "TRAINED" not in output
