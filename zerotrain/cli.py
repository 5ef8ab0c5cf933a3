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
from collections.abc import Collection, Sequence

from rich.console import Console
from rich.markup import escape

from zerotrain.config_check import parse_overrides, run_config_check  # noqa: F401 - parse_overrides is API
from zerotrain.error_report import UNEXPECTED_EXIT_CODE, USAGE_EXIT_CODE, error_console, print_user_error

# What a shell reports for a program stopped by SIGPIPE (128 + 13), as `yes | head -1` gives.
BROKEN_PIPE_EXIT_CODE = 141


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    launch = subparsers.add_parser(
        "launch",
        help="run a training script on this machine, or on every node of a hostfile",
        description="Run SCRIPT as one process per GPU (one process without GPUs) on this machine, or with a "
        "hostfile (default /job/hostfile, lines 'host slots=N') on every node it lists, over ssh, Slurm or "
        "MPI. Flags and their meanings are DeepSpeed's launcher's. Each rank gets RANK, LOCAL_RANK, "
        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT and --local_rank=K. Before a multi-node job starts, every node "
        "is checked (ssh, versions, script, GPUs, ulimits, master port); if a rank fails, every process of "
        "the job on every node is stopped and the first failure is shown.",
    )
    add_launch_flags(launch)
    launch.add_argument("script", metavar="SCRIPT", help="training script (or module with --module)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    launch.set_defaults(handler=run_launch)


def add_launch_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, skip: Collection[str] = ()
) -> list[argparse.Action]:
    """Adds `zerotrain launch`'s flags (DeepSpeed's launcher's) to `parser`, but those whose dest is
    in `skip`; returns their actions (`zerotrain bench run` passes the same flags on to every job)."""
    actions = []

    def add(*names: str, **options):
        long_name = next(n for n in names if n.startswith("--"))
        if options.get("dest", long_name[2:].replace("-", "_")) not in skip:
            actions.append(parser.add_argument(*names, **options))

    add("--num_gpus", "--num_accelerators", "--nproc_per_node", "--nproc-per-node", dest="nproc", type=int,
        default=None, metavar="N",
        help="processes per node (default: every slot of the hostfile, the local GPUs, or 1 without GPUs)")
    add("-H", "--hostfile", default=None, metavar="FILE",
        help="hostfile of 'host slots=N' lines (default: /job/hostfile; without one, run on this machine)")
    add("-i", "--include", default="", metavar="HOSTS", help="only these hosts/slots, e.g. worker-0@worker-1:0,2")
    add("-e", "--exclude", default="", metavar="HOSTS", help="all but these hosts/slots, e.g. worker-1:0")
    add("--num_nodes", type=int, default=-1, metavar="N", help="use the first N hosts of the hostfile")
    add("--master_addr", default=None, metavar="ADDR",
        help="rendezvous address (default: the first node, as ssh reaches it; 127.0.0.1 on one machine)")
    add("--master_port", type=int, default=None, metavar="PORT",
        help="rendezvous port (default: 29500; on one machine a free port if 29500 is busy)")
    add("--launcher", default="ssh", choices=["ssh", "pdsh", "openmpi", "mpich", "impi", "slurm"],
        help="how nodes are started: ssh (built in; pdsh is an alias), srun inside a Slurm allocation, "
        "or mpirun (default: %(default)s)")
    add("--launcher_args", default="", metavar="ARGS", help="extra arguments for srun or mpirun, as one string")
    add("--ssh_port", type=int, default=None, metavar="PORT", help="ssh port of every node")
    add("--ssh_args", default="", metavar="ARGS",
        help='extra options for every ssh call, as one string, e.g. "-F my_ssh_config -i key"')
    add("--node_rank", type=int, default=-1, metavar="K", help="this node's rank, with --no_ssh")
    add("--no_ssh", action="store_true",
        help="start only this node's ranks (run the same command on every node, each with --node_rank)")
    add("--force_multi", action="store_true", help="use the multi-node path even for a single node")
    add("--env", dest="env_flags", action="append", default=[], metavar="K=V",
        help="set a variable for every rank on every node (repeatable; after .deepspeed_env)")
    add("--save_pid", action="store_true", help="write the launcher's pid to /tmp/<pid>.deepspeed while it runs")
    add("--enable_each_rank_log", default=None, metavar="DIR", help="also write each rank's output to DIR")
    add("--elastic_training", action="store_true",
        help="elastic job: nodes may leave (or join) and the job goes on (c10d rendezvous)")
    add("--min_elastic_nodes", type=int, default=-1, metavar="N", help="fewest nodes an elastic job runs with")
    add("--max_elastic_nodes", type=int, default=-1, metavar="N", help="most nodes an elastic job runs with")
    add("--bind_cores_to_rank", action="store_true", help="pin each rank to its own share of the node's cores")
    add("--hang_timeout", type=float, default=None, metavar="S",
        help="after S seconds without output, every rank prints its Python stack (also on SIGUSR1 to the launcher)")
    add("--dry_run", action="store_true", help="print the node/rank table and each node's command; start nothing")
    add("--skip_preflight", action="store_true", help="start a multi-node job without checking the nodes first")
    add("--module", action="store_true", help="run SCRIPT as a module, like 'python -m'")
    add("--no_python", action="store_true", help="run SCRIPT as a program directly, not through python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=K to SCRIPT (LOCAL_RANK is still set)")
    return actions


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
        "validated and printed with every default filled in (--world-size applies to DeepSpeed configs only). "
        "Exits 2 with the reason when the config is invalid.",
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
    from zerotrain.bench.command import add_bench_parser
    from zerotrain.planning.estimate_command import add_estimate_parser
    from zerotrain.planning.plan_command import add_plan_parser
    from zerotrain.planning.wizard_command import add_init_parser
    from zerotrain.autotuning.tune_command import add_tune_parser
    from zerotrain.run_command import add_run_command_parser
    from zerotrain.train.command import add_run_parsers

    add_run_command_parser(subparsers)
    add_bench_parser(subparsers)
    add_estimate_parser(subparsers)
    add_plan_parser(subparsers)
    add_init_parser(subparsers)
    add_tune_parser(subparsers)

    add_run_parsers(subparsers)
    return parser


def launch_request(args: argparse.Namespace):
    """The ClusterLaunch that `zerotrain launch ARGS` asks for."""
    import shlex

    from zerotrain.launcher.multinode import ClusterLaunch
    from zerotrain.launcher.ssh import SshOptions

    return ClusterLaunch(
        target=args.script, target_args=tuple(args.script_args), module=args.module, no_python=args.no_python,
        local_rank_arg=not args.no_local_rank, hostfile=args.hostfile, hostfile_given=args.hostfile is not None,
        include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_gpus=args.nproc,
        master_addr=args.master_addr, master_port=args.master_port,
        launcher="ssh" if args.launcher == "pdsh" else args.launcher, launcher_args=args.launcher_args,
        ssh=SshOptions(port=args.ssh_port, extra_args=tuple(shlex.split(args.ssh_args))),
        node_rank=args.node_rank, no_ssh=args.no_ssh, force_multi=args.force_multi,
        env_flags=tuple(args.env_flags), elastic=args.elastic_training, min_nodes=args.min_elastic_nodes,
        max_nodes=args.max_elastic_nodes, bind_cores=args.bind_cores_to_rank, save_pid=args.save_pid,
        each_rank_log=args.enable_each_rank_log, hang_timeout=args.hang_timeout, dry_run=args.dry_run,
        skip_preflight=args.skip_preflight,
    )


def run_launch(args: argparse.Namespace) -> int:
    """`zerotrain launch`: runs the job (this machine, or every node of a hostfile); returns its exit status."""
    from zerotrain.deepspeed_standin import with_standin
    from zerotrain.launcher.local import LaunchError
    from zerotrain.launcher.multinode import launch

    # Every rank's `import deepspeed` is zerotrain (docs/huggingface.md).
    os.environ.update(with_standin(dict(os.environ)))
    try:
        return launch(launch_request(args))
    except LaunchError as error:
        print_user_error("zerotrain launch", error)
        return USAGE_EXIT_CODE


def run_consolidate(args: argparse.Namespace) -> int:
    """`zerotrain consolidate`: writes the model (0), or says why the checkpoint cannot be read (2)."""
    from rich.filesize import decimal
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from zerotrain.checkpoint import CheckpointError, consolidate, export_hf
    from zerotrain.checkpoint.errors import CorruptCheckpointError

    console = error_console()
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
