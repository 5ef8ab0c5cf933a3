"""`zerotrain consolidate`: its parser and its handler (progress on the terminal, a fix for a
checkpoint that cannot be read)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from zerotrain.config.error_report import USAGE_EXIT_CODE, error_console, print_user_error


def _shard_size(text: str) -> int:
    from zerotrain.config.byte_sizes import parse_byte_size

    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_consolidate_parser(subparsers: argparse._SubParsersAction) -> None:
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
        metavar="SIZE", help="largest output file: bytes, or 5GB, 500MB (powers of 10, as Hugging Face reads "
        "max_shard_size) or 2GiB, 512MiB (powers of 2) (default: %(default)s)",
    )
    consolidate.add_argument(
        "--hf", nargs="?", const="", default=None, metavar="MODEL_CONFIG_DIR",
        help="write a Hugging Face model directory: config.json and tokenizer files from MODEL_CONFIG_DIR, "
        "or without a value the config the checkpoint recorded. Put it after OUTPUT, or write --hf=DIR.",
    )
    consolidate.set_defaults(handler=run_consolidate)


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
