"""`zerotrain train`, `zerotrain logs` and `zerotrain stop`.

    zerotrain train [CONFIG.yaml] [--nproc_per_node N] [--resume] [--detach] [--section.key VALUE ...]
    zerotrain logs RUN_DIR [-f]
    zerotrain stop RUN_DIR [--wait SECONDS]

`train` reads and validates the config (and the overrides) before anything starts,
so a typo fails in a second, not after workers have spun up. Under a launcher
(`zerotrain launch`, torchrun, srun: RANK and WORLD_SIZE are set) every process
runs the trainer itself; otherwise it starts N local processes (every GPU, or 2 on
a CPU-only machine), each of which runs the merged config written to the run directory.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape

from zerotrain.config.error_report import USAGE_EXIT_CODE
from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES
from zerotrain.launcher.bootstrap import INTERRUPTED_EXIT_CODE  # a run stopped by Ctrl-C/SIGTERM, checkpointed

TRAIN_USAGE = (
    "zerotrain train [CONFIG.yaml] [--gpus-per-node N] [--hostfile FILE] [--resume | --resume-from CHECKPOINT | "
    "--overwrite] [--detach] "
    "[--section.key VALUE ...]"
)
# `zerotrain launch` flags that `zerotrain train` passes on to the multi-node launcher.
LAUNCH_FLAGS = ("--hostfile", "--include", "--exclude", "--num_nodes", "--master_addr", "--master_port",
                "--ssh_port", "--ssh_args", "--launcher")
RENDEZVOUS_FLAGS = {"master_addr", "master_port"}  # launch flags a run on this machine takes too
TRAIN_HELP = f"""usage: {TRAIN_USAGE}

Train or fine-tune a Hugging Face causal LM from one YAML file (sections model, data,
training, zero, logging, output). Without CONFIG it runs the embedded default: a small
Llama learning a generated arithmetic language on this machine.

  CONFIG.yaml           the run's config; `inherit: [base.yaml]` merges other files
  --section.key VALUE   override any key, e.g. --training.micro_batch_size 4
                        --zero.zero_optimization.stage 3 (VALUE is read as YAML)
  --gpus-per-node N     processes per machine (default: every GPU, or 2 without GPUs);
                        also --nproc_per_node, --num_gpus
  --hostfile FILE       train on every node of FILE ('host slots=N' lines), as
                        `zerotrain launch` does: pre-flight checks, one log, no
                        process left behind; output.dir must be on a filesystem
                        every node shares. With it: --include/--exclude HOSTS,
                        --nodes N (or --num_nodes), --master_addr A, --master_port P,
                        --ssh_port P, --ssh_args "...", --launcher ssh|slurm
  --resume              continue from the newest checkpoint in output.dir
  --resume-from CHECKPOINT
                        start from another run's checkpoint: a zerotrain checkpoints or tag
                        folder, or a DeepSpeed save_checkpoint folder (or its global_stepN):
                        weights, Adam moments and the step; the schedule continues at that
                        step, the data after its samples (training.resume in the YAML)
  --overwrite           start again in an output.dir that holds a run (deletes its
                        checkpoints and metrics); without it such a folder is refused
  --detach              run in the background (survives the terminal closing); then
                        `zerotrain logs RUN_DIR -f` and `zerotrain stop RUN_DIR`

Ctrl-C (or SIGTERM) stops after the current step with a checkpoint; resume with --resume.
ZEROTRAIN_DEBUG=1 shows full tracebacks.
"""
# How long `--detach` waits for every rank to be up before it reports the run started.
DETACH_START_TIMEOUT_S = 600.0


def split_train_argv(argv: Sequence[str]) -> tuple[str | None, dict, list[str]]:
    """(config path, trainer flags, override tokens) from `zerotrain train`'s arguments."""
    config: str | None = None
    flags: dict = {"nproc_per_node": None, "resume": False, "overwrite": False, "detach": False, "help": False,
                   "launch": {}, "resume_from": None}
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        name = token.split("=", 1)[0]
        if token in ("-h", "--help"):
            flags["help"] = True
        elif name in GPUS_PER_NODE:
            value, i = _flag_value(args, i, name)
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name} needs a positive number of processes, got {value!r}")
            flags["nproc_per_node"] = int(value)
        elif name in LAUNCH_FLAGS or name in NODES or name == "-H":
            value, i = _flag_value(args, i, name)
            key = "hostfile" if name == "-H" else "num_nodes" if name in NODES else name[2:]
            flags["launch"][key] = value
        elif token in ("--resume", "--overwrite", "--detach"):
            flags[token[2:]] = True
        elif name == "--resume-from":
            flags["resume_from"], i = _flag_value(args, i, name)
        elif token.startswith("--") and "." in name:
            overrides.append(token)
            if "=" not in token and i + 1 < len(args):
                overrides.append(args[i + 1])
                i += 1
        elif token.startswith("-"):
            raise ValueError(
                f"unknown flag {token!r}: config keys are set as --section.key VALUE (e.g. --training.lr 1e-4); "
                "see `zerotrain train --help`"
            )
        elif config is None:
            config = token
        else:
            raise ValueError(f"one config file is accepted, got {config!r} and {token!r} (use inherit: to merge files)")
        i += 1
    if flags["resume"] and flags["resume_from"]:
        raise ValueError("--resume continues this run's own checkpoints, --resume-from starts from another "
                         "checkpoint: choose one")
    return config, flags, overrides


def _flag_value(args: list[str], i: int, name: str) -> tuple[str, int]:
    if "=" in args[i]:
        return args[i].split("=", 1)[1], i
    if i + 1 >= len(args):
        raise ValueError(f"{name} needs a value")
    return args[i + 1], i + 1


def main_train(argv: Sequence[str], predict=None, rank_module: str = "zerotrain.train.worker") -> int:
    """`zerotrain train`: returns the exit status (a Ctrl-C before training starts is cli.main's).

    `predict(cfg, world, per_node)`: the step-time prediction to leave in the run folder for the
    trainer to compare with (the command layer passes it: train does not import planning).
    `rank_module`: what each rank of a multi-node run runs (`python -m`), the worker by default; the
    command layer names one that makes rank 0 predict first."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import print_user_error
    try:
        config, flags, overrides = split_train_argv(argv)
        if flags["help"]:
            print(TRAIN_HELP)
            return 0
        # The rest imports torch and transformers: not for --help.
        from zerotrain.train.config_files import load_train_config
        from zerotrain.train.metrics import check_sink_packages
        from zerotrain.train.data.build import check_data_sources
        from zerotrain.train.data_check import check_data_fits
        from zerotrain.runtime.chunked_loss import check_chunked_loss
        from zerotrain.train.model import check_model_config, model_type_of
        from zerotrain.train.run_control import RunControlError, clear_pid, write_pid
        from zerotrain.train.run_folder import check_can_start, check_no_live_run, clear_previous_run, resolve_resume
        from zerotrain.train.run_folder import discard_unstarted_run, first_missing_folder
        from zerotrain.train.run_folder import require_checkpoint_to_resume
        from zerotrain.train.rank_run import run_in_this_process
        from zerotrain.train.step_prediction import write_prediction
        from zerotrain.train.sequence_split import check_sequence_split
        from zerotrain.train.zero_fill import check_batch_at_world, wants_activation_offload
        cfg = load_train_config(config, overrides)
        check_sink_packages(cfg.logging)  # a missing wandb/tensorboard fails now, before any process starts
        check_model_config(cfg.model)  # a misspelt architecture or config_overrides key, likewise
        if cfg.training.loss_chunk_tokens:  # a head the chunked loss cannot reproduce, likewise
            check_chunked_loss(model_type_of(cfg.model))
        wants_activation_offload(cfg)  # offload without checkpointing, likewise
        # A missing file, a bad first record: once, here, not once per rank.
        check_data_sources(cfg.data, evaluate=cfg.training.eval_interval > 0)
        resume = "auto" if flags["resume"] else flags["resume_from"] or cfg.training.resume
        run_dir = Path(cfg.output.dir)
        under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ or _under_slurm_tasks()
        if not under_launcher:
            check_no_live_run(run_dir, own_pid=os.getpid())
        check_can_start(run_dir, resume, flags["overwrite"], config)
        if flags["resume"] and not under_launcher:
            require_checkpoint_to_resume(run_dir, config)
        point = resolve_resume(resume, run_dir)  # a bad training.resume fails now, not after start-up
        if point is not None and point.deepspeed is not None:  # a DeepSpeed run's: does it fit this model?
            from zerotrain.train.deepspeed_start import check_deepspeed_start
            check_deepspeed_start(cfg, point, config)
        prediction = None
        if not under_launcher and not set(flags["launch"]) - RENDEZVOUS_FLAGS:
            check_sequence_split(cfg, _local_processes(flags))  # N divides the ranks, seq_len, heads
            check_batch_at_world(cfg, _local_processes(flags))  # multi-node: the nodes' ranks check it
            groups = _local_processes(flags) // cfg.training.sequence_parallel_size  # the ways data is split
            if groups > 1:  # one: the trainer here checks it before training, as well
                check_data_fits(cfg, groups)
            if predict is not None and not flags["detach"]:  # a detached run predicts in its own process
                prediction = predict(cfg, _local_processes(flags), _local_processes(flags))
        elif predict is not None and under_launcher and os.environ.get("RANK") == "0":
            world = int(os.environ.get("WORLD_SIZE", "1"))
            prediction = predict(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except (ValueError, ConfigError) as error:
        print_user_error("zerotrain train", error)
        return USAGE_EXIT_CODE
    if flags["detach"]:
        try:
            return _detach(run_dir, [a for a in argv if a != "--detach"])
        except RunControlError as error:
            print_user_error("zerotrain train", error)
            return 1
    if flags["overwrite"] and os.environ.get("RANK", "0") == "0":
        removed = clear_previous_run(run_dir)
        if removed:
            Console(stderr=True, soft_wrap=True).print(
                f"[yellow]--overwrite: removed the earlier run's {', '.join(removed)} from {escape(str(run_dir))}[/]"
            )
    if under_launcher:
        if prediction is not None:
            write_prediction(run_dir, prediction)
        return run_in_this_process(cfg, resume)
    from zerotrain.launcher.local import DEFAULT_MASTER_ADDR, LaunchError, LocalLaunch, launch_local

    nproc = _local_processes(flags)
    made = first_missing_folder(run_dir)  # removed again if the ranks fail before training
    write_pid(run_dir)
    if prediction is not None:
        write_prediction(run_dir, prediction)
    given = flags["launch"]
    code = 1
    try:
        # Only a flag that names other nodes (or a launcher) leaves this machine: --master_port or
        # --master_addr alone used to send a local run down the multi-node path, with 1 process on a CPU.
        if set(given) - RENDEZVOUS_FLAGS:
            code = _train_on_nodes(cfg, run_dir, resume, flags, nproc, rank_module)
        elif nproc == 1:
            code = run_in_this_process(cfg, resume)
        else:
            request = LocalLaunch(
                target="zerotrain.train.worker", target_args=(str(cfg.write(run_dir)), "--resume", str(resume)),
                nproc=nproc, module=True, local_rank_arg=False,
                master_port=int(given["master_port"]) if "master_port" in given else None,
                master_addr=given.get("master_addr", DEFAULT_MASTER_ADDR),
            )
            try:
                code = launch_local(request, Console(stderr=True, soft_wrap=True), quiet_interrupt=True)
            except LaunchError as error:
                print_user_error("zerotrain train", error)
                code = USAGE_EXIT_CODE
        return code
    finally:
        clear_pid(run_dir)
        if made is not None and code not in (0, INTERRUPTED_EXIT_CODE):
            discard_unstarted_run(run_dir, made)


def _local_processes(flags: dict) -> int:
    return local_process_count(flags["nproc_per_node"])


def local_process_count(nproc_per_node: int | None = None) -> int:
    """Processes a run on this machine starts: --nproc_per_node, else every GPU, else 2 on a CPU
    (`zerotrain estimate`/`plan` of a train YAML assume the same)."""
    from zerotrain.launcher.local import visible_gpu_count

    return nproc_per_node or visible_gpu_count() or 2


def _train_on_nodes(cfg, run_dir: Path, resume, flags: dict, local_nproc: int,
                    rank_module: str = "zerotrain.train.worker") -> int:
    """The run on every node of a hostfile (or Slurm allocation), through `zerotrain launch`'s launcher.
    Without a hostfile the ssh launcher runs here: with as many processes as a local run."""
    from zerotrain.launcher.local import LaunchError
    from zerotrain.launcher.multinode import ClusterLaunch, launch
    from zerotrain.launcher.ssh import SshOptions

    given = flags["launch"]
    merged = cfg.write(run_dir)
    try:
        request = ClusterLaunch(
            target=rank_module, target_args=(str(merged), "--resume", str(resume)), module=True,
            local_rank_arg=False, hostfile=given.get("hostfile"), hostfile_given="hostfile" in given,
            include=given.get("include", ""), exclude=given.get("exclude", ""),
            num_nodes=int(given.get("num_nodes", -1)),
            num_gpus=flags["nproc_per_node"] or (
                local_nproc if "hostfile" not in given and given.get("launcher", "ssh") == "ssh" else None),
            master_addr=given.get("master_addr"),
            master_port=int(given["master_port"]) if "master_port" in given else None,
            launcher=given.get("launcher", "ssh"),
            ssh=SshOptions(port=int(given["ssh_port"]) if "ssh_port" in given else None,
                           extra_args=tuple(shlex.split(given.get("ssh_args", "")))),
        )
        return launch(request, Console(stderr=True, soft_wrap=True))
    except (LaunchError, ValueError) as error:
        from zerotrain.config.error_report import print_user_error

        print_user_error("zerotrain train", error)
        return USAGE_EXIT_CODE


def _detach(run_dir: Path, argv: list[str]) -> int:
    """Starts the run in the background and reports it started only once every rank is up."""
    from zerotrain.train.run_control import LOG_NAME, STARTED_NAME, detach, log_tail, wait_until_started

    out = Console(soft_wrap=True)
    child = detach(run_dir, argv)
    log = run_dir / LOG_NAME
    with Console(stderr=True).status(f"starting in the background (pid {child.pid}); waiting for every rank"):
        code = wait_until_started(run_dir, child, DETACH_START_TIMEOUT_S)
    if code is not None:
        err = Console(stderr=True, soft_wrap=True)
        err.print(f"[red]zerotrain train: the detached run exited with status {code} before it started training. "
                  f"Its log ({escape(str(log))}) ends with:[/]")
        err.print(escape(log_tail(run_dir)), highlight=False)
        return code or 1
    started = (run_dir / STARTED_NAME).exists()
    out.print(
        f"{'started' if started else 'still starting'} in the background (pid {child.pid}); "
        "it keeps running if this terminal closes\n"
        f"  log:    {escape(str(log))}\n"
        f"  follow: zerotrain logs {escape(shlex.quote(str(run_dir)))} -f\n"
        f"  stop:   zerotrain stop {escape(shlex.quote(str(run_dir)))}   (checkpoints first)"
    )
    return 0


def _under_slurm_tasks() -> bool:
    # srun starts one task per rank; each must train, not launch more processes.
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def add_run_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Registers `train` (for --help listings; main() dispatches it), `logs` and `stop`."""
    train = subparsers.add_parser("train", help="train a Hugging Face causal LM from one YAML config",
                                  add_help=False, usage=TRAIN_USAGE)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    logs = subparsers.add_parser("logs", help="print a run's log; -f follows it until the run ends")
    logs.add_argument("run_dir", metavar="RUN_DIR")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    logs.set_defaults(handler=run_logs)
    stop = subparsers.add_parser("stop", help="stop a run cleanly: it checkpoints, then exits")
    stop.add_argument("run_dir", metavar="RUN_DIR")
    stop.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                      help="how long to wait for the run to exit (default: %(default)s)")
    stop.set_defaults(handler=run_stop)


def run_logs(args: argparse.Namespace) -> int:
    from zerotrain.train.run_control import RunControlError, follow_log

    try:
        return follow_log(Path(args.run_dir), args.follow)
    except RunControlError as error:
        Console(stderr=True, soft_wrap=True).print(f"[red]zerotrain logs: {escape(str(error))}[/]")
        return 1


def run_stop(args: argparse.Namespace) -> int:
    from zerotrain.train.run_control import RunControlError, request_stop

    console = Console(stderr=True, soft_wrap=True)
    run_dir = Path(args.run_dir)
    try:
        with console.status(f"asked the run in {escape(str(run_dir))} to stop; waiting for its checkpoint"):
            done = request_stop(run_dir, args.wait)
    except RunControlError as error:
        console.print(f"[red]zerotrain stop: {escape(str(error))}[/]")
        return 1
    if not done:
        console.print(f"[yellow]zerotrain stop: the run has not exited after {args.wait:g} s; it will stop "
                      "after its current step and checkpoint (check with zerotrain logs)[/]")
        return 1
    console.print(f"stopped; resume with: zerotrain train {escape(shlex.quote(str(run_dir / 'config.yaml')))} --resume")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_train(sys.argv[1:]))
