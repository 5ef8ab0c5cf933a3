"""One rank's run: the trainer in this process, the user's errors it meets, and its last words.

Every rank of a launched `zerotrain train` job (and a one-process run) comes here: the worker
module, a rank under torchrun/srun, or the command itself with one process.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zerotrain.config.error_report import USAGE_EXIT_CODE
from zerotrain.launcher.bootstrap import INTERRUPTED_EXIT_CODE  # a run stopped by Ctrl-C/SIGTERM, checkpointed

# How long a rank other than 0 holds back a config or data error that rank 0 reports too.
REPEAT_ERROR_WAIT_S = 5.0


def run_in_this_process(cfg, resume: str) -> int:
    """Runs the trainer in this process (one rank of a launched job, or a single process)."""
    from zerotrain.checkpoint.errors import CheckpointError
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import print_user_error
    from zerotrain.train.data import DataError
    from zerotrain.train.trainer import Trainer

    rank = os.environ.get("RANK", "0")
    try:
        trainer = Trainer(cfg, resume=resume)
        summary = trainer.run()
    except (ConfigError, DataError) as error:
        # A problem with the user's config or data: the message names it and the fix; a traceback would bury it.
        _print_once_per_job(rank, lambda: print_user_error(f"zerotrain train (rank {rank})", error))
        return USAGE_EXIT_CODE
    except CheckpointError as error:
        print_user_error(f"zerotrain train (rank {rank})", error)
        return 1
    if summary["status"] == "stopped" and summary["stopped_by"] in ("SIGINT", "SIGTERM"):
        if trainer.rank == 0:
            Console(soft_wrap=True).print(
                f"stopped at step {summary['steps']} ({summary['stopped_by']}); checkpoint saved; resume with: "
                f"zerotrain train {escape(shlex.quote(str(Path(cfg.output.dir) / 'config.yaml')))} --resume"
            )
        return INTERRUPTED_EXIT_CODE
    if trainer.rank == 0:
        print_summary(summary, Console(soft_wrap=True))
    return 0


def _print_once_per_job(rank: str, report) -> None:
    """Config and data errors are the same on every rank: rank 0 reports at once; another rank waits
    a moment first, and the launcher, stopping the job on rank 0's report, ends it before it repeats
    the message. A rank alone in its error still reports it after the wait."""
    if rank != "0" and os.environ.get("WORLD_SIZE", "1") != "1":
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the trainer's graceful-stop handler would wait out the sleep
        time.sleep(REPEAT_ERROR_WAIT_S)
    report()


def print_summary(summary: dict, console: Console) -> None:
    """The one-screen report at the end of a run."""
    table = Table(title=f"zerotrain train: {summary['status']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("steps", f"{summary['steps']} ({summary['steps_this_run']} in this run)"),
        ("tokens", f"{summary['tokens']:,}"),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("mean tokens/s", f"{summary['mean_tokens_per_s']:,.0f}"),
        ("final loss", f"{summary['final_loss']:.4f}"),
    ]
    if "eval_loss" in summary:
        at = f" (step {summary['eval_step']})" if "eval_step" in summary else ""
        rows.append((f"eval loss / ppl{at}", f"{summary['eval_loss']:.4f} / {summary['eval_ppl']:.2f}"))
    rows += [("run directory", summary["run_dir"]), ("checkpoints", summary["checkpoints"])]
    if summary.get("hf_model"):
        rows.append(("Hugging Face model", summary["hf_model"]))
    if summary.get("metrics_csv"):
        rows.append(("metrics", summary["metrics_csv"]))
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    console.print(table)
