"""`zerotrain estimate MODEL`: the memory of every ZeRO rung, per GPU and per node, before any run.

The model is built on the meta device (nothing loaded or downloaded, see `model_source`).
The default output is zerotrain's own table: one line per rung of the ladder (stage x offload x
checkpointing) with parameters, gradients, optimizer state, gradient buckets, gathered units,
activations and the logits peak per GPU, and CPU and NVMe per node (`rung_memory`), and whether
each fits `--gpu-memory`/`--cpu-memory`. `--deepspeed-format` prints DeepSpeed's own two
tables, as `estimate_zero2_model_states_mem_needs_all_live` / `estimate_zero3_..._all_live` do;
`--json` gives both as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

def add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `estimate` to the `zerotrain` command."""
    from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES, add_shared_flag
    from zerotrain.planning import planning_args as pa

    parser = subparsers.add_parser(
        "estimate",
        help="estimate the memory a model needs per GPU and per CPU under each ZeRO option",
        description="Estimate the memory per GPU and per node of every ZeRO stage, offload and checkpointing "
        "choice for a model: model states to the byte the engine allocates, buffers, activations and the "
        "logits peak. Built from the model's config on the meta device: no weights are loaded, nothing is "
        "downloaded.",
    )
    pa.add_model_args(parser)
    add_shared_flag(parser, GPUS_PER_NODE, dest="gpus_per_node", type=pa.positive_int, default=None, metavar="N",
                        help="GPUs per node (default: for a train YAML, the processes `zerotrain train` starts "
                        "here, every GPU or 2 CPU ranks; else 1)")
    add_shared_flag(parser, NODES, dest="nodes", type=pa.positive_int, default=1, metavar="N", help="nodes (default 1)")
    parser.add_argument("--micro-batch", type=pa.positive_int, default=None, metavar="B",
                        help="samples per GPU per forward (default: a train YAML's training.micro_batch_size, else 1)")
    pa.add_workload_args(parser)
    pa.add_memory_args(parser)
    pa.add_max_seq_len_flag(parser)
    parser.add_argument(
        "--additional-buffer-factor", type=float, default=1.5, metavar="F",
        help="DeepSpeed's safety factor on CPU memory, for --deepspeed-format (default 1.5)",
    )
    parser.add_argument("--wide", action="store_true",
                        help="add a column per GPU memory term (parameters, gradients, optimizer, buckets, "
                        "gathered units, activations, logits): about 130 columns")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--deepspeed-format", action="store_true",
                        help="print DeepSpeed's own ZeRO-2 and ZeRO-3 tables (the guides' layout)")
    output.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.set_defaults(handler=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    """Prints the estimate; returns 0, or 2 when MODEL or a flag is wrong (the reason on stderr)."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning import planning_args as pa
    from zerotrain.planning.model_source import count_parameters
    from zerotrain.train.data import DataError

    try:
        model = pa.load_model(args)
        base = pa.base_config(args)
        ranks_from_train = args.gpus_per_node is None and pa.train_run(args) is not None
        if args.gpus_per_node is None:
            args.gpus_per_node = pa.train_run(args).processes if ranks_from_train else 1
        total, largest = count_parameters(model)
        if args.deepspeed_format:
            from zerotrain.planning.deepspeed_estimates import format_zero2_table, format_zero3_table

            hw = (args.gpus_per_node, args.nodes, args.additional_buffer_factor)
            if ranks_from_train:  # DeepSpeed's tables take no dtype: only the ranks were assumed
                print(pa.assumed_line(pa.train_run(args).describe(ranks=True, dtype=False)))
            print(format_zero2_table(total, *hw), end="")
            print(format_zero3_table(total, largest, *hw), end="")
            return 0
        if args.max_seq_len:
            report = _longest_report(args, model, base, total, ranks_from_train)
        else:
            report = estimate_report(args, model, base, total, largest, ranks_from_train)
    except (ConfigError, DataError, ValueError) as error:
        print_user_error("zerotrain estimate", error)
        return USAGE_EXIT_CODE
    print(json.dumps(report["json"], indent=2) if args.json else report["text"], end="" if not args.json else "\n")
    return 0


def estimate_report(args: argparse.Namespace, model, base: dict | None, total: int, largest: int,
                    ranks_from_train: bool = False) -> dict[str, Any]:
    """{"text": the native table, "json": every number} for the parsed flags (`ranks_from_train`: the
    GPU count is the processes `zerotrain train` would start here, said on the "assumed:" line)."""
    from zerotrain.planning import planning_args as pa
    from zerotrain.planning.deepspeed_estimates import zero2_options, zero3_options
    from zerotrain.planning.ladder import ladder
    from zerotrain.planning.model_source import assumed_sizes, parse_config_overrides
    from zerotrain.planning.plan_report import describe_setup, format_rung_table
    from zerotrain.planning.rung_memory import Workload, estimate_rung

    hardware = pa.hardware(args.gpus_per_node, args.nodes, args)
    train = pa.train_yaml(args)
    micro = args.micro_batch or (train.training.micro_batch_size if train is not None else 1)
    workload = Workload(pa.seq_len(args, model), micro, pa.compute_dtype(args, base), args.attention,
                        pa.loss_chunk_tokens(args), pa.long_sequence(args, base))
    rows = [estimate_rung(model, rung, workload, hardware, base)
            for rung in ladder(allow_nvme=True, checkpointing=args.gradient_checkpointing)]
    assumed = assumed_sizes(args.model, model, parse_config_overrides(args.config_overrides))
    notes = [line for line in (pa.assumed_line(pa.assumed_from_train(args, base, ranks_from_train)),
                               pa.decimal_gpu_memory_note(args.gpu_memory)) if line]
    text = "".join(f"{line}\n" for line in notes)
    text += describe_setup(args.model, total, hardware, workload, assumed) + "\n"
    text += format_rung_table(rows, hardware, args.wide)
    hw = (args.gpus_per_node, args.nodes, args.additional_buffer_factor)
    data = {
        "model": {"source": args.model, "total_params": total, "largest_layer_params": largest},
        "hardware": {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_memory": args.gpu_memory,
                     "cpu_memory": args.cpu_memory, "nvme": args.nvme},
        "workload": {"seq_len": workload.seq_len, "micro_batch": workload.micro_batch, "dtype": workload.dtype,
                     "attention": workload.attention, "loss_chunk_tokens": workload.loss_chunk_tokens,
                     "sequence_parallel_size": workload.long_sequence.sequence_parallel,
                     "tiled_mlp": workload.long_sequence.tiled_mlp,
                     "offload_activations": workload.long_sequence.offload_activations},
        "assumed": notes,
        "rungs": [row.as_dict() for row in rows],
        "deepspeed": {
            "additional_buffer_factor": args.additional_buffer_factor,
            "zero2": [row.as_dict() for row in zero2_options(total, *hw)],
            "zero3": [row.as_dict() for row in zero3_options(total, largest, *hw)],
        },
    }
    return {"text": text, "json": data}



def _longest_report(args: argparse.Namespace, model, base: dict | None, total: int,
                    ranks_from_train: bool) -> dict[str, Any]:
    """--max-seq-len: the longest sequence on these GPUs, as `plan --max-seq-len` answers it."""
    from zerotrain.planning import planning_args as pa
    from zerotrain.planning.longest_sequence_report import describe_hardware, longest_sequence_report
    from zerotrain.planning.rung_memory import Workload

    hardware = pa.hardware(args.gpus_per_node, args.nodes, args)
    workload = Workload(0, 1, pa.compute_dtype(args, base), args.attention, pa.loss_chunk_tokens(args),
                        pa.long_sequence(args, base))
    report = longest_sequence_report(model, hardware, workload, base, args.gradient_checkpointing)
    notes = [line for line in (pa.assumed_line(pa.assumed_from_train(args, base, ranks_from_train)),
                               pa.decimal_gpu_memory_note(args.gpu_memory)) if line]
    text = "".join(f"{line}\n" for line in notes) + describe_hardware(args.model, total, hardware, workload)
    text += report["text"]
    return {"text": text, "json": {"assumed": notes, **report["json"]}}
