"""Built-in workloads for `zerotrain bench run --workload NAME`: the embedded trainer on synthetic data.

Each is a `zerotrain train` config in zerotrain/bench/workloads/ (NAME.yaml, over base.yaml): a Llama of
the named size built from its config (nothing downloaded), generated data, 30 steps (llama-cpu: 20),
throughput in metrics.csv every 5 steps, no evaluation and no Hugging Face export.

A job runs it as `zerotrain launch [launch flags] <workload_target(NAME, JOB_DIR)>`, that is

    zerotrain launch ... --no_local_rank --module zerotrain train NAME.yaml --output.dir JOB_DIR/train

Under `zerotrain launch` every rank runs `zerotrain train` with RANK and WORLD_SIZE set, and `train`
then trains in that process (it does not start ranks of its own), so the launcher's hostfile, pre-flight
and teardown apply as for any script. `--no_local_rank`: `train` takes no `--local_rank=K` argument.
"""

from __future__ import annotations

from pathlib import Path

from zerotrain.bench.run_dir import TRAIN_DIR

WORKLOAD_DIR = Path(__file__).with_name("workloads")
WORKLOADS = ("llama-cpu", "llama-125m", "llama-350m", "llama-1b")
"""The names `--workload` takes, smallest first. llama-cpu is sized for trying the bench on CPUs (about
3 s a step on 2 cores, 20 steps); the others are for GPUs."""


class UnknownWorkloadError(ValueError):
    """A `--workload` name that is not built in; the message lists the names."""


def workload_config(name: str) -> Path:
    """The `zerotrain train` config of workload `name`; UnknownWorkloadError for another name."""
    if name not in WORKLOADS:
        raise UnknownWorkloadError(
            f"{name!r} is not a built-in workload; choose one of {', '.join(WORKLOADS)} "
            "(or give your own script or `--module zerotrain train CONFIG.yaml` after --)"
        )
    return WORKLOAD_DIR / f"{name}.yaml"


def workload_target(name: str, job_dir: Path) -> list[str]:
    """What follows `zerotrain launch`'s own flags to run workload `name` with its output in JOB_DIR/train.

    Starts with `--no_local_rank` (a launch flag: `zerotrain train` takes no --local_rank=K), then
    `--module zerotrain train CONFIG --output.dir JOB_DIR/train`. `zerotrain train` flags and
    `--section.key VALUE` overrides may follow (e.g. `--training.max_steps 50`).
    """
    config = workload_config(name)
    return ["--no_local_rank", "--module", "zerotrain", "train", str(config),
            "--output.dir", str(Path(job_dir) / TRAIN_DIR)]
