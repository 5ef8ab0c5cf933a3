"""One launch of a job script that runs several cases in turn (TRL's trainers, Lightning's strategies,
the Trainer's runs), so that a module pays the ranks' start-up once instead of once per case.

Such a script prints `SCRIPT: CASE starts` on stderr as each case begins; a failure is then told
against the case that was running: its part of stderr, whether it started at all."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import device_env, user_env


@dataclass
class CaseLaunch:
    """A finished launch: its command, exit status and output, the folder its script writes each
    case's results into, and `marker`, the script's stderr prefix."""

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    out: Path
    marker: str

    def started(self, case: str) -> bool:
        """Whether the script reached `case` (printed that it starts)."""
        return f"{self.marker}: {case} starts" in self.stderr

    def stderr_of(self, case: str) -> str:
        """The end of stderr from the line `case` starts with (all of it if the launch ended before):
        a failing case's traceback without the earlier cases' logs."""
        start = self.stderr.find(f"{self.marker}: {case} starts")
        return self.stderr[max(start, 0):][-6000:]

    def fail_for(self, case: str, missing: str) -> None:
        """Fails the test of `case`, which left no `missing`: says whether it started, how the
        launch ended, and shows its part of the output."""
        what = "started and wrote no" if self.started(case) else "never started (a case before it failed): no"
        pytest.fail(f"{case} {what} {missing}: `{' '.join(self.command)}` exited {self.returncode}\n"
                    f"{self.stdout[-2000:]}\n{self.stderr_of(case)}", pytrace=False)


def launch_cases(command: list[str], cwd: Path, out: Path, marker: str, timeout: float,
                 device: str = "cpu") -> CaseLaunch:
    """Runs `command` in `cwd` as a user with this venv active would, on `device`'s environment;
    `out` is where the command's script writes its cases' results."""
    done = subprocess.run(command, cwd=cwd, env=user_env(**device_env(device)), capture_output=True, text=True,
                          timeout=timeout)
    return CaseLaunch(command, done.returncode, done.stdout, done.stderr, out, marker)
