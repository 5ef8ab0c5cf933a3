"""What one bench job runs: the words after `--` (or a workload's), fitted to that job.

Two things the same words cannot do for every job at once, done here per job:

- zerotrain's own entry points (`--module zerotrain train my.yaml`, `--module zerotrain.bench.comm_worker`)
  take no `--local_rank=K` argument, which `zerotrain launch` passes unless told `--no_local_rank`:
  that flag is added, so the form a user writes runs as written.
- `zerotrain train`'s `output.dir`, when relative, would be the same folder for every job (the bench's
  working folder, where every rank runs): it becomes JOB_DIR/<output.dir>, one per job. The job's working
  folder stays the bench's, so the config file and relative data paths still resolve as the user wrote them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

NO_LOCAL_RANK = "--no_local_rank"


def _launch_actions() -> dict[str, argparse.Action]:
    """`zerotrain launch`'s flags by option string (-H, --hostfile, ...)."""
    from zerotrain.launcher.launch_command import add_launch_flags

    actions = add_launch_flags(argparse.ArgumentParser(add_help=False))
    return {option: action for action in actions for option in action.option_strings}


def split_target(words: Sequence[str]) -> tuple[set[str], int]:
    """(dests of the launch flags that lead `words`, index of the script) for what follows `zerotrain launch`.

    The index is len(words) when no script follows; an unknown flag ends the flags (launch will name it).
    """
    actions, flags, index = _launch_actions(), set(), 0
    while index < len(words) and words[index].startswith("-"):
        action = actions.get(words[index].split("=", 1)[0])
        if action is None:
            break
        flags.add(action.dest)
        takes_value = action.nargs != 0 and "=" not in words[index]
        index += 2 if takes_value else 1
    return flags, index


def _is_zerotrain(script: str, flags: set[str]) -> bool:
    """True when `script` is zerotrain itself: the package or one of its modules, or its console script."""
    if "module" in flags:
        return script == "zerotrain" or script.startswith("zerotrain.")
    return "no_python" in flags and Path(script).name == "zerotrain"


def train_output_dir(train_args: Sequence[str]) -> str | None:
    """`output.dir` of `zerotrain train TRAIN_ARGS` (config and overrides), or None when they do not load
    here: the job then reports that itself, with the trainer's own message."""
    from zerotrain.train.command import split_train_argv
    from zerotrain.train.config_files import load_train_config

    try:
        config, _, overrides = split_train_argv(train_args)
        return str(load_train_config(config, overrides).output.dir)
    except Exception:  # noqa: BLE001 - any config error is the job's to show, in its log
        return None


def job_target(words: Sequence[str], launch_flags: Sequence[str], job_dir: Path) -> list[str]:
    """`words` (what follows `zerotrain launch`'s own flags) for the job whose folder is `job_dir` (absolute).

    `launch_flags` are the flags bench run passes before them (`--module` may be given there). Adds
    `--no_local_rank` for zerotrain's own modules, and `--output.dir JOB_DIR/DIR` to `zerotrain train`
    whose output.dir DIR is relative (the last override wins).
    """
    words = list(words)
    flags, index = split_target(words)
    before, _ = split_target(launch_flags)
    if index >= len(words) or not _is_zerotrain(words[index], flags | before):
        return words
    if "no_local_rank" not in flags | before:
        words.insert(0, NO_LOCAL_RANK)
        index += 1
    if words[index + 1:index + 2] == ["train"]:
        output_dir = train_output_dir(words[index + 2:])
        if output_dir is not None and not Path(output_dir).expanduser().is_absolute():
            words += ["--output.dir", str(Path(job_dir) / output_dir)]
    return words
