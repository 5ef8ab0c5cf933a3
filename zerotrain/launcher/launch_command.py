"""`zerotrain launch`: its parser (DeepSpeed's launcher's flags) and its handler.

The flags are defined here, by the launcher, so that other jobs (`zerotrain bench run`, `bench
comm`) pass the very same flags on without importing the command line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection

from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES
from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error


def add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
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

    add(*GPUS_PER_NODE, dest="nproc", type=int,
        default=None, metavar="N",
        help="processes per node (default: every slot of the hostfile, the local GPUs, or 1 without GPUs)")
    add("-H", "--hostfile", default=None, metavar="FILE",
        help="hostfile of 'host slots=N' lines (default: /job/hostfile; without one, run on this machine)")
    add("-i", "--include", default="", metavar="HOSTS", help="only these hosts/slots, e.g. worker-0@worker-1:0,2")
    add("-e", "--exclude", default="", metavar="HOSTS", help="all but these hosts/slots, e.g. worker-1:0")
    add(*NODES, dest="num_nodes", type=int, default=-1, metavar="N", help="use the first N hosts of the hostfile")
    add("--master_addr", default=None, metavar="ADDR",
        help="rendezvous address (default: the first node, as ssh reaches it; 127.0.0.1 on one machine)")
    add("--master_port", type=int, default=None, metavar="PORT",
        help="rendezvous port (default: 29500 across nodes; on one machine a free port the launcher picks)")
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


def _runs_zerotrain(args: argparse.Namespace) -> bool:
    """`--module zerotrain ...`: zerotrain's own commands take no --local_rank (they read LOCAL_RANK)."""
    return bool(args.module) and (args.script == "zerotrain" or args.script.startswith("zerotrain."))


def launch_request(args: argparse.Namespace):
    """The ClusterLaunch that `zerotrain launch ARGS` asks for."""
    import shlex

    from zerotrain.launcher.multinode import ClusterLaunch
    from zerotrain.launcher.ssh import SshOptions

    return ClusterLaunch(
        target=args.script, target_args=tuple(args.script_args), module=args.module, no_python=args.no_python,
        local_rank_arg=not args.no_local_rank and not _runs_zerotrain(args), hostfile=args.hostfile, hostfile_given=args.hostfile is not None,
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
    from zerotrain.compat.deepspeed_standin import with_standin
    from zerotrain.compat.json_only_configs import check_json_loadable, trainer_config_arguments
    from zerotrain.config.errors import ConfigError
    from zerotrain.launcher.local import LaunchError
    from zerotrain.launcher.multinode import launch

    # Every rank's `import deepspeed` is zerotrain (docs/huggingface.md).
    os.environ.update(with_standin(dict(os.environ)))
    try:
        check_json_loadable(trainer_config_arguments(args.script_args))  # a Trainer's --deepspeed FILE
        return launch(launch_request(args))
    except (LaunchError, ConfigError) as error:
        print_user_error("zerotrain launch", error)
        return USAGE_EXIT_CODE
