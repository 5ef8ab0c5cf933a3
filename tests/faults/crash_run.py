"""One crash-consistency trial: a short `zerotrain train` job killed at a named moment, then resumed.

Shared by tests/faults/test_crash_consistency.py (one moment per kind, in `make test`) and
tests/faults/soak.py (`make soak`: every moment x victim x stage, randomized arrivals).

A trial runs the job with ZEROTRAIN_FAULT=POINT:VICTIM:N (zerotrain/comm/fault_points.py) and a job id
of its own (ZEROTRAIN_JOB_ID, which the launcher, a detached launcher and every rank carry, so that every
process it started can be found afterwards: the ranks run in sessions of their own), then checks:
- `latest`, if present, names a complete tag (its meta.json is there);
- nothing of the job is still running once the launcher is gone (within a grace period);
- `zerotrain train --training.resume auto` finishes, says where it resumed (or that it starts over),
  and its metrics.csv losses equal the uninterrupted run's, bitwise, at every step;
- afterwards the checkpoints folder holds only the kept tags: no temporary folder, no half `latest`,
  and the NVMe folder holds no swap files.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import zerotrain_script  # noqa: E402
from free_ports import free_port  # noqa: E402

from zerotrain.launcher.job_processes import job_processes, signal_processes  # noqa: E402
from zerotrain.launcher.node_job import JOB_ID_ENV  # noqa: E402

STEPS = 6
SAVE_EVERY = 2
KEEP = 2
# The job: 2 ranks, the default tiny Llama on generated data, a checkpoint every 2 steps.
JOB = ["--training.max_steps", str(STEPS), "--training.save_interval", str(SAVE_EVERY), "--training.eval_interval",
       "0", "--logging.interval", "1", "--data.synthetic.num_examples", "400", "--training.micro_batch_size", "4",
       "--output.keep_checkpoints", str(KEEP), "--output.export_hf", "false", "--nproc_per_node", "2"]
LEFTOVER_GRACE_S = 40.0  # a rank whose launcher died stops after its current step (bootstrap.watch_parent)

# Which arrival numbers a moment has in this job (per process): the engine's calls once a step, a
# save's points once a save, an NVMe write several times a step.
ARRIVALS = {"forward": STEPS, "backward": STEPS, "optimizer_step": STEPS, "shard_write": STEPS // SAVE_EVERY,
            "before_latest": STEPS // SAVE_EVERY, "nvme_write": 4 * STEPS}


@dataclass
class Trial:
    """What one trial did and found; `problems` is empty when every check held."""

    stage: int
    point: str
    victim: str
    n: int
    detach: bool = False
    killed: bool = False
    resumed_from: str = ""
    equal: bool = False
    leftovers: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def job_args(run: Path, stage: int, nvme: Path | None, cache: Path) -> list[str]:
    # A port of this test worker's own block: a default port picked as free can be taken by another
    # worker's job before the rendezvous binds it.
    args = ["train", "--output.dir", str(run), "--data.cache_dir", str(cache), *JOB,
            "--zero.zero_optimization.stage", str(stage), "--master_port", str(free_port())]
    if nvme is not None:
        args += ["--zero.zero_optimization.offload_optimizer", f"{{device: nvme, nvme_path: {nvme}}}"]
    return args


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ZEROTRAIN_FAULT"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def losses(run: Path) -> list[tuple[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(row["step"], row["loss"]) for row in csv.DictReader(f)]


def reference(tmp: Path, stage: int, nvme: bool) -> list[tuple[str, str]]:
    """The uninterrupted run's (step, loss) rows."""
    run = tmp / f"reference-stage{stage}{'-nvme' if nvme else ''}"
    swap = tmp / "nvme-ref" if nvme else None
    if swap:
        swap.mkdir(exist_ok=True)
    done = subprocess.run([zerotrain_script(), *job_args(run, stage, swap, tmp / "cache")], env=environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return losses(run)


def _job_processes(job_id: str) -> list[str]:
    """The live processes carrying `job_id` (a zombie's environment reads empty): "pid name" each."""
    found = []
    for pid in job_processes(job_id):
        try:
            found.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
        except OSError:
            pass  # gone meanwhile
    return found


def _wait_for_no_leftovers(job_id: str) -> list[str]:
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := _job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def run_trial(tmp: Path, stage: int, point: str, victim: str, n: int, expected: list[tuple[str, str]],
              detach: bool = False) -> Trial:
    """Kills the job at POINT:VICTIM:N, resumes it, and checks what is described in the module docstring."""
    trial = Trial(stage, point, victim, n, detach)
    run = tmp / f"run-{stage}-{point}-{victim}-{n}{'-detach' if detach else ''}"
    nvme = tmp / f"nvme-{run.name}" if point == "nvme_write" else None
    if nvme:
        nvme.mkdir()
    args = job_args(run, stage, nvme, tmp / "cache")
    job_id = f"crash-trial-{uuid.uuid4().hex[:12]}"
    env = environment(ZEROTRAIN_FAULT=f"{point}:{victim}:{n}", **{JOB_ID_ENV: job_id})
    proc = subprocess.Popen([zerotrain_script(), *args, *(["--detach"] if detach else [])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, _ = proc.communicate(timeout=300)
    if detach:  # the detached launcher runs in a session of its own: follow it until it is gone
        pid = int((run / "train.pid").read_text()) if (run / "train.pid").exists() else None
        deadline = time.monotonic() + 300
        while pid is not None and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        out += (run / "train.log").read_text() if (run / "train.log").exists() else ""
    summary = run / "summary.json"
    finished = summary.is_file() and '"status": "finished"' in summary.read_text()
    # Killed: a non-zero exit; detached, the run did not finish, or its launcher died without
    # clearing its pid file (the ranks may have finished the last steps before they noticed).
    trial.killed = (not finished or (run / "train.pid").exists()) if detach else proc.returncode != 0
    trial.leftovers = _wait_for_no_leftovers(job_id)
    if trial.leftovers:
        trial.problems.append(f"left running: {trial.leftovers}")
        signal_processes(job_processes(job_id), signal.SIGKILL)  # only what this trial started
    checkpoints = run / "checkpoints"
    latest = checkpoints / "latest"
    if latest.exists() and not (checkpoints / latest.read_text().strip() / "meta.json").is_file():
        trial.problems.append(f"`latest` names an incomplete tag: {latest.read_text().strip()!r}")
    again = [zerotrain_script(), *job_args(run, stage, nvme, tmp / "cache"), "--training.resume", "auto"]
    resumed = subprocess.run(again, env=environment(), capture_output=True, text=True, timeout=300)
    said = [line for line in resumed.stdout.splitlines() if "resumed from" in line or "starting from step 0" in line]
    trial.resumed_from = said[0] if said else ""
    if resumed.returncode != 0:
        trial.problems.append(f"resume failed ({resumed.returncode}): {(resumed.stdout + resumed.stderr)[-1500:]}")
        return trial
    if not said:
        trial.problems.append("the resumed run did not say where it resumed from")
    trial.equal = losses(run) == expected
    if not trial.equal:
        trial.problems.append(f"losses differ from the uninterrupted run: {losses(run)} vs {expected}")
    hidden = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("."))
    tags = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step"))
    # A stop saves the step it stopped at (off the save interval): any KEEP tags, the last one final.
    if hidden or len(tags) != KEEP or f"step{STEPS}" not in tags:
        trial.problems.append(f"checkpoints folder holds {hidden + tags}: expected {KEEP} tags, step{STEPS} the "
                              "newest, and no temporary files")
    if nvme is not None and any(nvme.iterdir()):
        trial.problems.append(f"NVMe swap files left: {sorted(p.name for p in nvme.iterdir())}")
    if not trial.killed:
        trial.problems.append(f"the fault did not kill anything: {out[-1500:]}")
    return trial
