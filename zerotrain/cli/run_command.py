"""`zerotrain run [--] COMMAND ...`: runs any command with `import deepspeed` meaning zerotrain.

    zerotrain run accelerate launch --config_file acc.yaml train.py
    zerotrain run torchrun --nproc_per_node 2 train.py --deepspeed ds_config.json
    zerotrain run python train.py

The command replaces this process (its exit status and signals are its own); it and every
process it starts find the `deepspeed` stand-in first on PYTHONPATH and a `deepspeed`
command (`zerotrain launch`) first on PATH. See zerotrain/compat/deepspeed_standin.py.

Before that, what would fail on every rank stops here (a DeepSpeed JSON with comments given to
the Trainer or to Accelerate, which `json.load` it), and what `accelerate launch` with DeepSpeed
would drop without a word (a dynamo backend) is passed on to the ranks and said in one line.
"""

from __future__ import annotations

import argparse
import os
import shutil

from zerotrain.compat.deepspeed_standin import with_standin
from zerotrain.config.error_report import USAGE_EXIT_CODE, error_console, print_user_error
from zerotrain.config.errors import UserInputError


def add_run_command_parser(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="run a command (accelerate launch, torchrun, python ...) with `import deepspeed` meaning zerotrain",
        description="Runs COMMAND with zerotrain standing in for DeepSpeed: Hugging Face Trainer and Accelerate "
        "scripts with a DeepSpeed config run unchanged (torch.compile, when asked for, is zerotrain's: "
        "each decoder layer compiled in place).",
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
    try:
        env = _checked_environment(words, env)
    except UserInputError as error:
        print_user_error("zerotrain run", error)
        return USAGE_EXIT_CODE
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


def _checked_environment(words: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment to run `words` in, once nothing in them would fail on every rank.

    Raises UserInputError for a DeepSpeed config file the libraries cannot read, or a dynamo backend
    Accelerate refuses; an `accelerate launch` with DeepSpeed gets its dynamo settings in the ranks'
    environment, which its own DeepSpeed launcher leaves out, and one line saying what is compiled
    (compat/compile_settings.py).
    """
    from rich.markup import escape

    from zerotrain.compat.accelerate_launch_args import accelerate_launch_words, read_accelerate_launch
    from zerotrain.compat.compile_settings import dynamo_launch
    from zerotrain.compat.json_only_configs import (
        accelerate_config_arguments,
        check_json_loadable,
        trainer_config_arguments,
    )

    arguments = accelerate_launch_words(words)
    if arguments is None:
        check_json_loadable(trainer_config_arguments(words))
        return env
    launch = read_accelerate_launch(arguments, env)
    check_json_loadable(accelerate_config_arguments(launch, env))
    dynamo = dynamo_launch(launch, env)
    if dynamo is None:
        return env
    if dynamo.compiles:
        error_console().print(f"zerotrain run: {escape(dynamo.announcement())}")
    return {**env, **dynamo.env}
