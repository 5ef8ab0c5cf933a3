"""The `zerotrain` command: parses the command line and hands off to the subcommand.

    zerotrain launch [-H HOSTFILE] [-i/-e HOSTS] [--num_nodes N] [--num_gpus N] [--master_addr A]
                     [--master_port P] [--launcher ssh|slurm|openmpi|...] [--dry_run] [...] SCRIPT [ARGS...]
    zerotrain config check PATH [--world-size N] [--set KEY=VALUE ...]
    zerotrain consolidate CHECKPOINT_DIR OUTPUT [--tag T] [--dtype fp32|bf16|fp16]
                          [--max-shard-size 5GB] [--hf [MODEL_CONFIG_DIR]]
    zerotrain train [CONFIG.yaml] [--nproc_per_node N] [--resume] [--detach] [--section.key VALUE ...]
    zerotrain logs RUN_DIR [-f]
    zerotrain stop RUN_DIR
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence


from zerotrain.checkpoint.consolidate_command import add_consolidate_parser
from zerotrain.cli.config_check import add_config_parser, parse_overrides  # noqa: F401 - parse_overrides is API
from zerotrain.launcher.launch_command import add_launch_parser
from zerotrain.config.error_report import UNEXPECTED_EXIT_CODE, print_user_error
from zerotrain.system.process_exit import run_then_exit

# What a shell reports for a program stopped by SIGPIPE (128 + 13), as `yes | head -1` gives.
BROKEN_PIPE_EXIT_CODE = 141


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `zerotrain` command, with all its subcommands."""
    from zerotrain import __version__

    parser = argparse.ArgumentParser(
        prog="zerotrain", description="ZeRO distributed training for PyTorch, DeepSpeed-compatible."
    )
    parser.add_argument("--version", action="version", version=f"zerotrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_launch_parser(subparsers)
    add_config_parser(subparsers)
    add_consolidate_parser(subparsers)
    from zerotrain.bench.command import add_bench_parser
    from zerotrain.planning.estimate_command import add_estimate_parser
    from zerotrain.planning.plan_command import add_plan_parser
    from zerotrain.planning.wizard_command import add_init_parser
    from zerotrain.autotuning.tune_command import add_tune_parser
    from zerotrain.cli.run_command import add_run_command_parser
    from zerotrain.train.command import add_run_parsers

    add_run_command_parser(subparsers)
    add_bench_parser(subparsers)
    add_estimate_parser(subparsers)
    add_plan_parser(subparsers)
    add_init_parser(subparsers)
    add_tune_parser(subparsers)

    add_run_parsers(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zerotrain` console script and of `python -m zerotrain`.

    A subcommand's unexpected error is shown as one line (ZEROTRAIN_DEBUG=1 adds the
    traceback), exit 1; output cut short by its reader (`zerotrain ... | head`) ends quietly.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = f"zerotrain {argv[0]}" if argv and not argv[0].startswith("-") else "zerotrain"
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, so a reader that has gone away is handled below
    except BrokenPipeError as error:
        if not _stdout_closed():
            print_user_error(command, error)
            return UNEXPECTED_EXIT_CODE
        # Python's documented recipe: point stdout at devnull so the flush at exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT_CODE
    except KeyboardInterrupt:
        print_user_error(command, "interrupted")
        return 130  # 128 + SIGINT, as a shell reports it
    except Exception as error:  # noqa: BLE001 - the last stop before a traceback reaches the user
        print_user_error(command, error)
        return UNEXPECTED_EXIT_CODE


def console_main() -> None:
    """The `zerotrain` console script and `python -m zerotrain`: `main`, then the process ends
    without the interpreter's teardown (about 1.5 s once torch is imported; see
    zerotrain/system/process_exit.py). In-process callers use `main`, which returns."""
    run_then_exit(main)


def _run(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        # `train` takes free-form --section.key VALUE overrides, which argparse cannot express.
        from zerotrain.train.command import main_train

        return main_train(argv[1:], predict=_predict_train_step, rank_module="zerotrain.cli.train_rank")
    parser = build_parser()
    if not argv:  # as git and cargo do: the commands, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    return int(args.handler(args))


def _predict_train_step(cfg, world: int, per_node: int) -> dict | None:
    """`train`'s step-time prediction, imported when a run asks for it: the planner imports torch,
    which `zerotrain train --help` does not need."""
    from zerotrain.cli.train_prediction import predict_train_step

    return predict_train_step(cfg, world, per_node)


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone away (a pipe with no reader polls as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or stdout is not a file
        return True
