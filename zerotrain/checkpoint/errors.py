"""CheckpointError: a checkpoint that cannot be written or read, with the file to blame."""

from __future__ import annotations

import shlex
from pathlib import Path

from zerotrain.config.errors import ConfigError, UserInputError

RUN_CONFIG = "config.yaml"  # what `zerotrain train` writes next to a run's checkpoints folder


class CheckpointError(RuntimeError, UserInputError):
    """Raised for a missing, truncated, foreign or inconsistent checkpoint; the message names the file."""


class CorruptCheckpointError(CheckpointError, ConfigError):
    """A file of a saved checkpoint is missing, truncated or corrupt.

    The message names the file and the way back: the previous tag in the same folder and
    the command that loads it (or says there is none).  It is a ConfigError too: the input
    is bad, not the program, so `zerotrain train` reports it in one line (exit 2).
    """

    def __init__(self, problem: str, save_dir: Path, previous_tag: str | None) -> None:
        self.problem = problem
        self.save_dir = Path(save_dir)
        self.previous_tag = previous_tag
        super().__init__(self.with_command(self.default_command()))

    def default_command(self) -> str | None:
        """How to load the previous tag: `zerotrain train` when the folder is a run's, else the engine call."""
        if self.previous_tag is None:
            return None
        run_config = self.save_dir.parent / RUN_CONFIG
        if run_config.is_file():
            return (
                f"zerotrain train {shlex.quote(str(run_config))} "
                f"--training.resume {shlex.quote(str(self.save_dir / self.previous_tag))}"
            )
        return f"engine.load_checkpoint({str(self.save_dir)!r}, tag={self.previous_tag!r})"

    def with_command(self, command: str | None) -> str:
        """The whole message, with `command` as the way to use the previous tag."""
        if self.previous_tag is None:
            return (
                f"{self.problem}. There is no earlier intact checkpoint in {self.save_dir} to fall back to: "
                "restore the file from a copy, or start again without resuming"
            )
        return (
            f"{self.problem}. The previous checkpoint in {self.save_dir} is {self.previous_tag!r}; "
            f"use it instead: {command}"
        )
