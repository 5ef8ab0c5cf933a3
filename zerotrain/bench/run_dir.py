"""The layout of a `zerotrain bench run` folder: what `run` writes and `report` reads.

    RUN_DIR/
      run.json              the command every job ran, the timeout, when it started
      JOB/                  one per hostfile, named after it (hostfiles/batch-003 -> batch-003)
        hostfile            the hostfile the job ran on
        log.txt             everything `zerotrain launch` printed (stdout and stderr, merged)
        status.json         JobStatus: nodes, state, exit code, elapsed time
        train/              the output folder of a built-in workload (`--workload`): metrics.csv
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from zerotrain.system.durable_files import atomic_write_text

RUN_FILE = "run.json"
STATUS_FILE = "status.json"
LOG_FILE = "log.txt"
HOSTFILE = "hostfile"
TRAIN_DIR = "train"

JobState = Literal["pending", "running", "finished", "failed", "timeout"]
"""finished: exit 0; failed: a non-zero exit (report calls it a crash); timeout: stopped at --timeout."""


@dataclass
class JobStatus:
    """One job of a run, as `status.json` holds it."""

    job: str
    """The job's name: its hostfile's file name without suffix."""
    nodes: list[str]
    """The hosts of its hostfile, in order."""
    state: JobState = "pending"
    exit_code: int | None = None
    """`zerotrain launch`'s exit status; None while running or when it was stopped at the timeout."""
    elapsed_s: float | None = None
    master_port: int | None = None
    started: str | None = None
    """ISO 8601 time the launch started."""
    ended: str | None = None
    extra: dict = field(default_factory=dict)
    """Anything else a writer wants to keep (e.g. the last throughput seen; a failed job's `reason`)."""

    def write(self, job_dir: Path) -> None:
        """Replaces JOB/status.json atomically (report may read it while the run goes on)."""
        job_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(job_dir / STATUS_FILE, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, job_dir: Path) -> JobStatus:
        data = json.loads((job_dir / STATUS_FILE).read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def job_dirs(run_dir: Path) -> list[Path]:
    """The run's job folders (those holding a status.json), sorted by name."""
    return sorted(p for p in run_dir.iterdir() if (p / STATUS_FILE).is_file())
