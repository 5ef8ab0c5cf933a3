"""`zerotrain run [--] COMMAND ...`: runs any command with `import deepspeed` meaning zerotrain.

    zerotrain run accelerate launch --config_file acc.yaml train.py
    zerotrain run torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json
    zerotrain run python train.py

The command replaces this process (its exit status and signals are its own); it and every
process it starts find the `deepspeed` stand-in first on PYTHONPATH and a `deepspeed`
command (`zerotrain launch`) first on PATH. See zerotrain/compat/deepspeed_standin.py.
"""

from __future__ import annotations

import argparse
import os
import shutil

from zerotrain.compat.deepspeed_standin import with_standin
from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error


def add_run_command_parser(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a command (accelerate launch, torchrun, python ...) with `import deepspeed` meaning zerotrain",
        description="Runs COMMAND with zerotrain standing in for DeepSpeed: Hugging Face Trainer and Accelerate "
        "scripts with a DeepSpeed config run unchanged, with nothing compiled.",
    )
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                     help="the command and its arguments (a leading -- is optional)")
    run.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Replaces this process with the command; returns only when it cannot be started."""
    words = list(args.command_line)
    if words[:1] == ["--"]:
        words = words[1:]
    if not words:
        print_user_error("zerotrain run", "no command given: e.g. `zerotrain run accelerate launch train.py`")
        return USAGE_EXIT_CODE
    env = with_standin(dict(os.environ))
    program = shutil.which(words[0], path=env["PATH"])
    if program is None:
        print_user_error("zerotrain run", f"command not found: {words[0]!r} (is it installed in this environment?)")
        return 127  # as a shell reports a missing command
    try:
        os.execve(program, words, env)
    except OSError as error:
        print_user_error("zerotrain run", f"cannot run {program}: {error.strerror}")
        return 126
    return 0  # not reached
