"""`zerotrain train` end to end: the embedded default, resume after a crash, metrics files, detach/stop."""

from __future__ import annotations

import csv
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import device_env, on_gpu, zerotrain_script

pytestmark = pytest.mark.slow  # every test here starts processes: `make test`, not `make check`

ZEROTRAIN = [zerotrain_script()]  # the installed console script, as users run it
# A short job on the default model and data: 12 steps, a checkpoint at step 8 (and the final one at 12), a
# metrics row every step.
SHORT = [
    "--training.max_steps", "12", "--training.save_interval", "8", "--training.eval_interval", "6",
    "--training.micro_batch_size", "4", "--logging.interval", "1", "--data.synthetic.num_examples", "2000",
]


def _train(tmp_path: Path, run: str, *args: str, env: dict | None = None, check: bool = True):
    cmd = [*ZEROTRAIN, "train", "--output.dir", str(tmp_path / run), "--data.cache_dir", str(tmp_path / "cache"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # exited but not reaped: a zombie
    except FileNotFoundError:
        return False


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("device", ["cpu", on_gpu("gpu", "gpu-1process")])
def test_embedded_default_trains_to_the_end_and_writes_a_loadable_model(tmp_path, device):
    # exactly `make demo`'s job, in a temporary directory; on a GPU one process (NCCL, bf16 by default)
    one_gpu = ["--nproc_per_node", "1"] if device == "gpu" else []
    _train(tmp_path, "demo", *one_gpu, env=device_env(device))
    run = tmp_path / "demo"
    rows = _rows(run / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(10, 201, 10))
    first, last = float(rows[0]["loss"]), float(rows[-1]["loss"])
    assert last < 0.5 * first, (first, last)  # stated margin: the loss at least halves
    evals = _rows(run / "eval.csv")
    assert int(evals[0]["step"]) == 0 and int(evals[-1]["step"]) == 200
    assert float(evals[-1]["eval_loss"]) < 0.5 * float(evals[0]["eval_loss"])
    assert (run / "checkpoints" / "latest").read_text().strip() == "step200"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(run / "hf")
    ids = tokenizer("12+7=", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]

    # Fine-tune that directory (weights and tokenizer) on prompt/response JSONL: model.path + data.path.
    # One process, in the command's own (no launcher, no second rank): loading is what this checks, and
    # two ranks were the demo's; no evaluation, which nothing here reads.
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "{a}+{b}=", "response": "{a + b}"}}\n' for a in range(40) for b in range(10)))
    _train(tmp_path, "sft", "--model.path", str(run / "hf"), "--data.path", str(data), "--data.format", "auto", "--data.seq_len", "32",
           "--training.max_steps", "4", "--training.micro_batch_size", "4", "--logging.interval", "1",
           "--training.eval_interval", "0", "--nproc_per_node", "1", env=device_env(device))
    tuned = _rows(tmp_path / "sft" / "metrics.csv")
    assert len(tuned) == 4 and float(tuned[0]["loss"]) < first  # starts from the trained weights, not from scratch
    assert (tmp_path / "sft" / "hf" / "tokenizer.json").is_file()


@dataclass
class CrashAndResume:
    """The SHORT job on 2 CPU processes, TensorBoard on, killed after its last step (before its final
    save), then resumed with `--master_port` given: its folder, metrics.csv and `latest` as the crash left
    them, both processes, and the port."""

    run: Path
    crashed: subprocess.CompletedProcess
    crashed_rows: list[dict]
    crashed_latest: str
    resumed: subprocess.CompletedProcess
    port: str


@pytest.fixture(scope="module")
def crash_and_resume(tmp_path_factory) -> CrashAndResume:
    """Shared by the crash/resume test and the rendezvous flag test (how many processes the flag left
    the resumed run). The crashed run logged every step's loss before the kill, uninterrupted: those
    rows are the uninterrupted losses the resume must reproduce, with no third run to compute them."""
    from free_ports import free_port

    root, port = tmp_path_factory.mktemp("crash"), str(free_port())
    run, cpu, tensorboard = root / "resumed", device_env("cpu"), ["--logging.tensorboard.enabled", "true"]
    crashed = _train(root, "resumed", *SHORT, *tensorboard, env={**cpu, "ZEROTRAIN_FAULT": "after_step:all:12"},
                     check=False)
    crashed_rows = _rows(run / "metrics.csv") if (run / "metrics.csv").is_file() else []
    latest = run / "checkpoints" / "latest"
    crashed_latest = latest.read_text().strip() if latest.is_file() else ""
    resumed = _train(root, "resumed", *SHORT, *tensorboard, "--resume", "--master_port", port, env=cpu, check=False)
    return CrashAndResume(run, crashed, crashed_rows, crashed_latest, resumed, port)


@pytest.mark.timeout(600)
def test_resume_after_a_crash_reproduces_the_uninterrupted_losses(crash_and_resume):
    job = crash_and_resume
    assert job.crashed.returncode != 0, job.crashed.stdout[-2000:]
    whole = job.crashed_rows  # steps 1-12, each run once, without a break
    assert [int(r["step"]) for r in whole] == list(range(1, 13)), job.crashed.stdout[-2000:] + job.crashed.stderr[-2000:]
    assert job.crashed_latest == "step8"  # the final save (step 12) never happened: steps 9-12 are redone
    assert job.resumed.returncode == 0, job.resumed.stdout[-3000:] + job.resumed.stderr[-3000:]
    assert "resumed from" in job.resumed.stdout and "step8" in job.resumed.stdout, job.resumed.stdout[-2000:]

    resumed = _rows(job.run / "metrics.csv")
    assert [int(r["step"]) for r in resumed] == list(range(1, 13))  # rows 9-12 of the crashed run replaced
    for a, b in zip(whole, resumed):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6, abs=1e-7), a["step"]
    fields = ["step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "tflops",
              "mem_alloc_gb_r0", "mem_peak_gb_r0", "mem_alloc_gb_r1", "mem_peak_gb_r1"]
    assert all(r[f] != "" for r in whole + resumed for f in fields)
    assert list((job.run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.timeout(300)
def test_detached_run_is_followed_and_stopped_cleanly_after_a_checkpoint(tmp_path, zerotrain_main):
    run = tmp_path / "bg"
    args = ["--training.max_steps", "100000", "--training.save_interval", "0", "--training.eval_interval", "0",
            "--training.micro_batch_size", "4", "--data.synthetic.num_examples", "2000"]
    # The command runs in this process (it only starts the run); the run it detaches is processes of its own.
    started = zerotrain_main("train", "--output.dir", run, "--data.cache_dir", tmp_path / "cache", *args,
                             "--nproc_per_node", "2", "--detach", check=True)
    # "started" only once the ranks are up: rank 0 writes train.started once every engine is built
    assert started.stdout.startswith("started in the background"), started.stdout + started.stderr
    assert (run / "train.started").exists()
    assert "zerotrain logs" in started.stdout
    pid = int((run / "train.pid").read_text())
    deadline = time.time() + 180
    while "step 10 " not in (run / "train.log").read_text() + " ":
        assert time.time() < deadline, (run / "train.log").read_text()[-2000:]
        time.sleep(0.2)
    stop = subprocess.run([*ZEROTRAIN, "stop", str(run)], capture_output=True, text=True, timeout=200)
    assert stop.returncode == 0, stop.stderr
    from zerotrain.train.run_control import running_pid

    assert running_pid(run) is None and not _alive(pid)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("step") and int(latest[4:]) >= 10
    logs = zerotrain_main("logs", run)  # reads the folder: in this process
    assert "stopped" in logs.stdout and not (run / "STOP").exists()


def test_bad_data_stops_the_job_with_its_message_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json}\n')
    proc = _train(tmp_path, "bad", "--nproc_per_node", "1", "--data.path", str(bad), "--data.format", "auto",
                  check=False)
    assert proc.returncode == 2
    assert "bad.jsonl" in proc.stderr and "line 2" in proc.stderr and "Traceback" not in proc.stderr


# --master_addr takes the same path as --master_port
def test_a_rendezvous_flag_never_changes_how_many_processes_a_local_run_starts(crash_and_resume):
    # `--master_port` used to send the run down the multi-node path, whose CPU default was 1 process.
    proc, port = crash_and_resume.resumed, crash_and_resume.port  # a local run given --master_port, no --nproc_per_node
    assert "zerotrain launch: 2 processes" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "; 2 ranks," in proc.stdout, proc.stdout[-2000:]
    assert f"127.0.0.1:{port}" in proc.stderr + proc.stdout


def test_batch_sizes_that_do_not_multiply_out_at_the_world_size_fail_before_any_rank(zerotrain_main, tmp_path):
    # Refused before any rank starts: in this process (the other tests here run the console script).
    proc = zerotrain_main("train", "--output.dir", tmp_path / "runs" / "b", "--data.cache_dir", tmp_path / "cache",
                          "--nproc_per_node", "2", "--zero.train_batch_size", "6", "--training.micro_batch_size", "2",
                          env=device_env("cpu"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "zerotrain launch" not in proc.stderr + proc.stdout  # no rank was started
    assert "zero.train_batch_size = 6" in proc.stderr and "world size 2 = 4" in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing written


def test_an_error_found_in_tokenized_data_is_printed_once_and_leaves_no_run_folder(zerotrain_main, tmp_path):
    one = tmp_path / "one.jsonl"  # one document: too few to hold out an evaluation split, known only once tokenized
    one.write_text('{"text": "a single short document"}\n')
    # The command tokenizes before it starts any rank (the data-fits check) and stops there: in this process.
    proc = zerotrain_main("train", "--output.dir", tmp_path / "runs" / "one", "--data.cache_dir", tmp_path / "cache",
                          "--nproc_per_node", "2", "--data.path", one, "--data.format", "auto", env=device_env("cpu"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert out.count("too few to hold out") == 1, out[-3000:]
    assert not (tmp_path / "runs").exists()  # the ranks' config.yaml went with the folder the launch made
