"""The machine: device, versions, per-rank thread settings, and how busy the rest of it is.

On a shared machine another job's load, not the engine, can dominate a step-time
difference; the harness waits for quiet before each engine and records the CPU
other processes used during each run.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def resolve_machine(args) -> dict:
    import torch

    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.device == "cuda" and not cuda:
        sys.exit("--device cuda: no CUDA device visible")
    if args.nproc is None:
        args.nproc = min(2, torch.cuda.device_count()) if cuda else 2
    if cuda and args.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA devices (one rank per GPU)")
    cores = os.cpu_count() or 1
    if args.threads is None:
        args.threads = max(1, cores // args.nproc)
    env = worker_env(args.threads, cuda)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({cores} cores: {cpu})"
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "zerotrain", "deepspeed"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    versions["zerotrain_commit"] = _commit()
    return {"cuda": cuda, "env": env, "device": device, "cores": cores, "versions": versions}


def worker_env(threads: int, cuda: bool) -> dict[str, str]:
    """The environment every engine process gets: its thread counts, and on a CPU run no GPU and
    DeepSpeed's CPU accelerator."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _commit() -> str | None:
    """The checkout's commit, with "+dirty" when zerotrain/ has uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "zerotrain").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "") if head.returncode == 0 else None



def busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy (all processes), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def foreign_load(seconds: float = 2.0) -> float:
    """Cores' worth of CPU used by processes other than this harness over `seconds`."""
    b0, o0 = busy_cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    b1, o1 = busy_cpu_s(), resource.getrusage(resource.RUSAGE_SELF)
    own = (o1.ru_utime + o1.ru_stime) - (o0.ru_utime + o0.ru_stime)
    return max(0.0, (b1 - b0 - own) / seconds)


def wait_idle(limit_s: float, on_wait=None) -> float:
    """Waits (up to limit_s) until other processes use less than a quarter of a core; returns that load."""
    deadline = time.monotonic() + limit_s
    load = foreign_load()
    if load > 0.25 and on_wait is not None:
        on_wait(load)
    while load > 0.25 and time.monotonic() < deadline:
        load = foreign_load(5.0)
    return load
