"""The `zerotrain` command: parses the command line and hands off to the subcommand.

    zerotrain launch [--num_gpus N] [--master_addr A] [--master_port P]
                     [--module] [--no_python] [--no_local_rank] SCRIPT [ARGS...]
    zerotrain config check PATH [--world-size N] [--set KEY=VALUE ...]
    zerotrain consolidate CHECKPOINT_DIR OUTPUT [--tag T] [--dtype fp32|bf16|fp16]
                          [--max-shard-size 5GB] [--hf [MODEL_CONFIG_DIR]]
    zerotrain train [CONFIG.yaml] [--nproc_per_node N] [--resume] [--detach] [--section.key VALUE ...]
    zerotrain logs RUN_DIR [-f]
    zerotrain stop RUN_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.json import JSON
from rich.markup import escape

from zerotrain.error_report import print_user_error

# Exit status for a bad command line or an invalid config, as argparse uses.
USAGE_EXIT_CODE = 2
# Exit status for an error that is not the user's input (a bug, or the environment).
UNEXPECTED_EXIT_CODE = 1
# What a shell reports for a program stopped by SIGPIPE (128 + 13), as `yes | head -1` gives.
BROKEN_PIPE_EXIT_CODE = 141
# Top-level keys that make a YAML file a `zerotrain train` config rather than a DeepSpeed one.
TRAIN_CONFIG_KEYS = frozenset({"inherit", "model", "data", "training", "zero", "logging", "output"})


def _stderr() -> Console:
    # soft_wrap: messages keep their own line breaks instead of being folded at 80 columns.
    return Console(stderr=True, soft_wrap=True)


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    launch = subparsers.add_parser(
        "launch",
        help="run a training script as N processes on this machine",
        description="Run SCRIPT as N processes on this machine, one per GPU (one process without "
        "GPUs). Each process gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its "
        "environment and, as with DeepSpeed's launcher, --local_rank=K on its command line. If a "
        "rank fails, the others are stopped and its exit code is returned.",
    )
    launch.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--nproc_per_node",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=None,
        metavar="N",
        help="number of processes (default: the number of local GPUs, or 1 without GPUs)",
    )
    launch.add_argument(
        "--master_addr", default="127.0.0.1", metavar="ADDR", help="rendezvous address (default: %(default)s)"
    )
    launch.add_argument(
        "--master_port",
        type=int,
        default=None,
        metavar="PORT",
        help="rendezvous port (default: 29500, or a free port if 29500 is busy)",
    )
    launch.add_argument("--module", action="store_true", help="run SCRIPT as a module, like 'python -m'")
    launch.add_argument(
        "--no_python", action="store_true", help="run SCRIPT as a program directly, not through python"
    )
    launch.add_argument(
        "--no_local_rank", action="store_true", help="do not pass --local_rank=K to SCRIPT (LOCAL_RANK is still set)"
    )
    launch.add_argument("script", metavar="SCRIPT", help="training script (or module with --module)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    launch.set_defaults(handler=run_launch)


def _add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser(
        "config", help="work with DeepSpeed and zerotrain train config files",
        description="Work with DeepSpeed and zerotrain train config files.",
    )
    config_commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = config_commands.add_parser(
        "check",
        help="validate a config and print it with every value resolved",
        description="Load a DeepSpeed config (JSON, with comments allowed), resolve its \"auto\" "
        "values for the given world size and print the result. A zerotrain train YAML (sections model, "
        "data, training, zero, logging, output, or inherit) is merged with the files it inherits, "
        "validated and printed with every default filled in. Exits 2 with the reason when the config "
        "is invalid.",
    )
    check.add_argument("path", metavar="PATH", help="the config file")
    check.add_argument(
        "--world-size",
        "--world_size",
        dest="world_size",
        type=int,
        default=1,
        metavar="N",
        help="number of ranks to resolve batch sizes for (default: %(default)s)",
    )
    check.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='value for a key the config sets to "auto", dotted, e.g. scheduler.params.total_num_steps=100; '
        "VALUE is read as JSON when it parses (1e-3, true, [1,2]), else as a string. For a zerotrain train "
        "YAML, any key: the same as --section.key VALUE on zerotrain train. Repeatable.",
    )
    check.set_defaults(handler=run_config_check)


def _shard_size(text: str) -> int:
    from zerotrain.checkpoint.consolidate import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _add_consolidate_parser(subparsers: argparse._SubParsersAction) -> None:
    consolidate = subparsers.add_parser(
        "consolidate",
        help="write a checkpoint's full model as safetensors or a Hugging Face model directory",
        description="Gather the fp32 master weights of a checkpoint saved at any world size and stage "
        "into one model: safetensors files (sharded Hugging Face style past --max-shard-size), or with "
        "--hf a directory that transformers' from_pretrained loads. Memory stays near one output shard.",
    )
    consolidate.add_argument(
        "checkpoint_dir", metavar="CHECKPOINT_DIR", help="the save directory (or one tag directory inside it)"
    )
    consolidate.add_argument(
        "output", metavar="OUTPUT", help="output directory (or, without --hf, a file name ending in .safetensors)"
    )
    consolidate.add_argument("--tag", default=None, metavar="TAG", help="checkpoint tag (default: the one in `latest`)")
    consolidate.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default=None,
        help="dtype of the weights written (default: fp32; with --hf, the config's dtype)",
    )
    consolidate.add_argument(
        "--max-shard-size", "--max_shard_size", dest="max_shard_size", type=_shard_size, default="5GB",
        metavar="SIZE", help="largest output file, e.g. 5GB, 500MB, 2GiB or bytes (default: %(default)s)",
    )
    consolidate.add_argument(
        "--hf", nargs="?", const="", default=None, metavar="MODEL_CONFIG_DIR",
        help="write a Hugging Face model directory: config.json and tokenizer files from MODEL_CONFIG_DIR, "
        "or without a value the config the checkpoint recorded. Put it after OUTPUT, or write --hf=DIR.",
    )
    consolidate.set_defaults(handler=run_consolidate)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `zerotrain` command, with all its subcommands."""
    from zerotrain import __version__

    parser = argparse.ArgumentParser(
        prog="zerotrain", description="ZeRO distributed training for PyTorch, DeepSpeed-compatible."
    )
    parser.add_argument("--version", action="version", version=f"zerotrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_launch_parser(subparsers)
    _add_config_parser(subparsers)
    _add_consolidate_parser(subparsers)
    from zerotrain.train.command import add_run_parsers

    add_run_parsers(subparsers)
    return parser


def run_launch(args: argparse.Namespace) -> int:
    """`zerotrain launch`: runs the script on this machine and returns the job's exit status."""
    from zerotrain.launcher.local import LaunchError, LocalLaunch, launch_local

    request = LocalLaunch(
        target=args.script,
        target_args=tuple(args.script_args),
        nproc=args.nproc,
        master_addr=args.master_addr,
        master_port=args.master_port,
        module=args.module,
        no_python=args.no_python,
        local_rank_arg=not args.no_local_rank,
    )
    try:
        return launch_local(request)
    except LaunchError as error:
        print_user_error("zerotrain launch", error)
        return USAGE_EXIT_CODE


def parse_overrides(items: Sequence[str]) -> dict[str, object]:
    """Turns ``["a.b=1e-3", "c=x"]`` into ``{"a.b": 0.001, "c": "x"}`` (JSON values where they parse)."""
    overrides: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value: object = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        overrides[key.strip()] = value
    return overrides


_MISSING = object()


def _value_at(data: object, dotted_key: str) -> object:
    """`data["a"]["b"]` for "a.b", or `_MISSING` when the path is absent."""
    for part in dotted_key.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def run_config_check(args: argparse.Namespace) -> int:
    """`zerotrain config check`: prints the resolved config (0), or why it is invalid (2)."""
    from zerotrain.config import ConfigError, load_config, resolve_config

    console = _stderr()
    try:
        if is_train_config(args.path):
            return _check_train_config(args, console)
        overrides = parse_overrides(args.overrides)
        cfg = resolve_config(load_config(args.path), world_size=args.world_size, model=None, auto_values=overrides)
    except (ConfigError, ValueError, OSError) as error:
        # The message is the whole story (it names the file, key and fix); a traceback would bury it.
        print_user_error("zerotrain config check", error, console)
        if '"auto"' in str(error):
            console.print('[dim]fill "auto" values here with --set KEY=VALUE[/]')
        return USAGE_EXIT_CODE
    resolved = cfg.model_dump(mode="json", exclude_none=True)
    for key, value in overrides.items():
        # resolve_config fills only "auto" values and ignores other keys: say so.
        if _value_at(resolved, key) != value:
            console.print(
                f"[yellow]--set {escape(key)} had no effect: only values the config sets to \"auto\" are filled[/]"
            )
    # soft_wrap: long strings must not be folded, so the output stays valid JSON.
    Console().print(JSON.from_data(resolved), soft_wrap=True)
    return 0


def is_train_config(path: str | os.PathLike) -> bool:
    """Whether PATH is a `zerotrain train` YAML (its top-level keys are train sections), not a DeepSpeed config."""
    from zerotrain.config.loader import read_config_file

    file = Path(path)
    if file.suffix.lower() not in (".yaml", ".yml") or not file.is_file():
        return False
    data = read_config_file(file)
    return isinstance(data, dict) and not TRAIN_CONFIG_KEYS.isdisjoint(data)


def _check_train_config(args: argparse.Namespace, console: Console) -> int:
    """A `zerotrain train` YAML: merged, overridden by --set, validated; printed as YAML with defaults filled."""
    import yaml

    from zerotrain.config import ConfigError, check_supported
    from zerotrain.train.config import load_train_config

    overrides = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides.append(f"--{key.strip()}={value}")
    cfg = load_train_config(args.path, overrides)
    # What the trainer would refuse only after its workers have started: a misspelt architecture,
    # features not built, DeepSpeed monitor sections.  Every problem is reported at once.
    problems = []
    if cfg.model.architecture is not None:
        from zerotrain.train.model_checks import check_architecture

        problems += _problem(check_architecture, cfg.model.architecture)
    problems += _problem(lambda: check_supported(cfg.zero_config(), prefix="zero."))
    if problems:
        raise ConfigError(f"{args.path}:\n" + "\n".join(f"  {p}" for p in problems) if len(problems) > 1 else problems[0])
    for note in cfg.notes:
        console.print(f"[dim]{escape(note)}[/]")
    print(yaml.safe_dump(cfg.as_dict(), sort_keys=False, allow_unicode=True), end="")
    return 0


def run_consolidate(args: argparse.Namespace) -> int:
    """`zerotrain consolidate`: writes the model (0), or says why the checkpoint cannot be read (2)."""
    from rich.filesize import decimal
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from zerotrain.checkpoint import CheckpointError, consolidate, export_hf
    from zerotrain.checkpoint.errors import CorruptCheckpointError

    console = _stderr()
    counts = {"tensors": 0, "bytes": 0}
    with Progress(
        TextColumn("[bold]consolidating[/] {task.description}"), BarColumn(), DownloadColumn(),
        TimeRemainingColumn(), console=console, transient=True, disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("", total=None)

        def on_tensor(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            counts.update(tensors=done, bytes=done_bytes)
            progress.update(task, description=f"{done}/{total} tensors", completed=done_bytes, total=total_bytes)

        common = {"tag": args.tag, "max_shard_size": args.max_shard_size, "progress": on_tensor}
        try:
            if args.hf is None:
                written = consolidate(args.checkpoint_dir, args.output, dtype=args.dtype or "fp32", **common)
            else:
                written = export_hf(
                    args.checkpoint_dir, args.output, hf_config_dir=args.hf or None, dtype=args.dtype, **common
                )
        except CorruptCheckpointError as error:
            progress.stop()
            fix = error.with_command(_consolidate_command(args, error))
            print_user_error("zerotrain consolidate", error, console, message=fix)
            return USAGE_EXIT_CODE
        except (CheckpointError, OSError) as error:
            # The message names the file and the fix; a traceback would bury it.
            progress.stop()
            print_user_error("zerotrain consolidate", error, console)
            return USAGE_EXIT_CODE
    names = [p.name for p in written]
    listed = ", ".join(names) if len(names) <= 4 else f"{len(names)} files ({names[0]} ... {names[-1]})"
    kind = "Hugging Face model" if args.hf is not None else "model"
    Console(soft_wrap=True).print(
        f"wrote {kind} to {escape(str(written[0].parent))}: {counts['tensors']} tensors, "
        f"{decimal(counts['bytes'])} in {escape(listed)}"
    )
    return 0


def _problem(check, *args) -> list[str]:
    """The message of the ConfigError `check(*args)` raises, as a list of none or one."""
    from zerotrain.config import ConfigError

    try:
        check(*args)
    except ConfigError as error:
        return [str(error)]
    return []


def _consolidate_command(args: argparse.Namespace, error) -> str | None:
    """This same `zerotrain consolidate` command, on the previous tag of the checkpoint folder."""
    import shlex

    if error.previous_tag is None:
        return None
    words = ["zerotrain", "consolidate", str(error.save_dir), args.output, "--tag", error.previous_tag]
    if args.dtype:
        words += ["--dtype", args.dtype]
    if args.max_shard_size != _shard_size("5GB"):
        words += ["--max-shard-size", str(args.max_shard_size)]
    if args.hf is not None:
        words.append(f"--hf={args.hf}" if args.hf else "--hf")
    return shlex.join(words)


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


def _run(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        # `train` takes free-form --section.key VALUE overrides, which argparse cannot express.
        from zerotrain.train.command import main_train

        return main_train(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args))


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone away (a pipe with no reader polls as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or stdout is not a file
        return True
