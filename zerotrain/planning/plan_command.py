"""`zerotrain plan MODEL --gpus N --gpu-memory 80GiB ...`: which ZeRO configuration to run, and why.

Prints the recommendation in words (the fastest rung that fits, its micro-batch and
accumulation), why each faster rung does not fit, the minimum GPU counts, then the config as
DeepSpeed JSON and as a `zerotrain train` YAML section. `--verify` runs three real steps of it.
"""

from __future__ import annotations

import argparse
import json


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `plan` to the `zerotrain` command."""
    from zerotrain.config.flag_spellings import GPUS_PER_NODE, NODES, add_shared_flag
    from zerotrain.planning import planning_args as pa

    parser = subparsers.add_parser(
        "plan",
        help="pick the fastest ZeRO stage, offload and micro-batch that fit your GPUs",
        description="Walk the ladder of ZeRO configurations (stage 0, 1, 2, 2 + optimizer offload, 3, "
        "3 + offloads, NVMe; each without, with selective and with whole-layer gradient checkpointing) on the "
        "memory model and recommend the fastest that fits, with the micro-batch and accumulation that keep the global batch.",
    )
    pa.add_model_args(parser)
    parser.add_argument("--gpus", type=pa.positive_int, default=None, metavar="N",
                        help="GPUs in all (or give --nodes: --nodes x --gpus-per-node; default: for a train YAML "
                        "the processes `zerotrain train` starts here, else the smallest --scale count)")
    add_shared_flag(parser, GPUS_PER_NODE, dest="gpus_per_node", type=pa.positive_int, default=None, metavar="N",
                        help="GPUs per node (default: --gpus up to 8)")
    add_shared_flag(parser, NODES, dest="nodes", type=pa.positive_int, default=None, metavar="N",
                        help="nodes (default: --gpus / --gpus-per-node)")
    parser.add_argument("--global-batch", type=pa.positive_int, default=None, metavar="B",
                        help="samples per optimizer step over all GPUs (default: a train YAML's micro-batch x "
                        "accumulation x GPUs)")
    pa.add_workload_args(parser)
    pa.add_memory_args(parser)
    pa.add_max_seq_len_flag(parser)
    from zerotrain.planning.speed_args import add_speed_args

    add_speed_args(parser)
    parser.add_argument("--scale", metavar="N,N,...", default=None, type=_gpu_counts,
                        help="predict tokens/s per GPU and in all at these GPU counts (e.g. 8,64,512,4096) "
                        "for each stage, at the same global batch")
    parser.add_argument("--plot", metavar="PNG", default=None, help="with --scale: draw the curves into PNG")
    parser.add_argument("--verify", action="store_true",
                        help="run 3 real steps of the chosen config on this machine's devices (synthetic data) "
                        "and compare measured with predicted memory; falls to the next rung if it does not fit")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--master_port", "--master-port", type=pa.positive_int, default=None, metavar="PORT",
                        help="with --verify: the ranks' rendezvous port (default: a free one)")
    parser.set_defaults(handler=run_plan)


def _gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts like 8,64,512, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive GPU counts like 8,64,512, got {text!r}")
    return sorted(set(counts))


def _resolve_gpu_count(args: argparse.Namespace) -> str | None:
    """Fills --gpus from --nodes x --gpus-per-node, else from a train YAML (the processes `zerotrain train`
    starts here) or the smallest --scale count, or checks that the three agree. Returns where an
    unstated count came from: "train" or "scale" (None: the flags gave it)."""
    from zerotrain.planning import planning_args as pa

    if args.gpus is None:
        if args.nodes is not None and args.gpus_per_node is not None:
            args.gpus = args.nodes * args.gpus_per_node
            return None
        if args.nodes is None and args.gpus_per_node is None:
            run = pa.train_run(args)
            if run is not None:
                args.gpus = args.gpus_per_node = run.processes
                return "train"
            if args.scale:
                args.gpus = min(args.scale)
                return "scale"
        raise ValueError("say how many GPUs: --gpus N (in all), or --nodes N with --gpus-per-node N")
    if args.nodes is not None:
        per_node = args.gpus_per_node or args.gpus // args.nodes
        if args.nodes * per_node != args.gpus:
            raise ValueError(f"--gpus {args.gpus} is not --nodes {args.nodes} x --gpus-per-node {per_node}")
        args.gpus_per_node = per_node
    return None


def _global_batch(args: argparse.Namespace) -> str | None:
    """Fills --global-batch from a train YAML (micro-batch x accumulation x GPUs); returns the
    "assumed" words for it, None when --global-batch was given. ValueError when neither says."""
    from zerotrain.planning import planning_args as pa

    if args.global_batch is not None:
        return None
    cfg = pa.train_yaml(args)
    if cfg is None:
        raise ValueError("--global-batch is required (samples per optimizer step over all GPUs), "
                         "e.g. --global-batch 256")
    t = cfg.training
    args.global_batch = t.micro_batch_size * t.gradient_accumulation_steps * args.gpus
    return (f"global batch {args.global_batch} (training.micro_batch_size {t.micro_batch_size} x "
            f"gradient_accumulation_steps {t.gradient_accumulation_steps} x {args.gpus} GPUs)")


def run_plan(args: argparse.Namespace) -> int:
    """Prints the plan; 0 when something fits, 1 when nothing does, 2 for a wrong MODEL or flag."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning import planning_args as pa
    from zerotrain.planning.model_source import count_parameters
    from zerotrain.planning.plan_report import describe_setup, format_plan, plan_json, train_yaml_section
    from zerotrain.planning.activation_memory import LongSequence
    from zerotrain.planning.planner import make_plan
    from zerotrain.train.data import DataError

    if args.max_seq_len:
        return _run_max_seq_len(args)
    try:
        gpus_from = _resolve_gpu_count(args)
        batch_from = _global_batch(args)
        per_node, assumed_cpu = _node_layout(args, "a plan needs to know what fits")
        model = pa.load_model(args)
        base = pa.base_config(args)
        hardware = pa.hardware(per_node, args.gpus // per_node, args)
        from zerotrain.planning.speed_args import rates_from_args

        rates, assumed_speed = rates_from_args(args, per_node)
        if args.plot and not args.scale:
            raise ValueError("--plot draws the --scale curves: give --scale too, e.g. --scale 8,64,512")
        if pa.long_sequence(args, base) != LongSequence():
            raise ValueError("--sequence-parallel, --tiled-mlp and --offload-activations are planned with "
                             "--max-seq-len (the longest sequence they reach); `zerotrain estimate` counts them "
                             "at a given --seq-len")
        plan = make_plan(model, hardware, pa.seq_len(args, model), args.global_batch, pa.compute_dtype(args, base),
                         args.attention, base, args.gradient_checkpointing, rates=rates,
                         loss_chunk_tokens=pa.loss_chunk_tokens(args))
        assumed = _assumed_lines(args, base, gpus_from, batch_from)
    except (ConfigError, DataError, ValueError) as error:
        print_user_error("zerotrain plan", error)
        return USAGE_EXIT_CODE
    if args.verify and plan.choice is not None:
        from zerotrain.planning.plan_verify import verify_plan

        plan = verify_plan(plan, model, args, base)
    ds_config = plan.deepspeed_config(base) if plan.choice else None
    curves = None
    if args.scale:
        from zerotrain.planning.scale_curve import scale_curves

        curves = scale_curves(model, plan, args.scale, base)
    if args.json:
        print(plan_json(plan, ds_config, curves, assumed))
        return 0 if plan.choice else 1
    for line in assumed + assumed_speed:
        print(line)
    total, _ = count_parameters(model)
    _say_assumed_cpu(assumed_cpu)
    from zerotrain.planning.model_source import assumed_sizes, parse_config_overrides

    sizes = assumed_sizes(args.model, model, parse_config_overrides(args.config_overrides))
    print(describe_setup(args.model, total, hardware, plan.workload_at_choice() if plan.choice else plan.workload,
                         sizes))
    print(format_plan(plan))
    if ds_config is not None:
        print("DeepSpeed config (ds_config.json):")
        print(json.dumps(ds_config, indent=2))
        print("\nzerotrain train YAML:")
        print(train_yaml_section(plan, ds_config), end="")
    if curves is not None:
        from zerotrain.planning.scale_curve import format_scale, plot_scale

        print()
        print(format_scale(curves), end="")
        if args.plot:
            plot_scale(curves, args.plot)
            print(f"plot: {args.plot}")
    return 0 if plan.choice else 1


def _run_max_seq_len(args: argparse.Namespace) -> int:
    """`plan --max-seq-len`: the longest sequence on these GPUs, the switches that go longer, and the
    config that runs it; 0 when something fits, 1 when nothing does, 2 for a wrong MODEL or flag."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.config.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning import planning_args as pa
    from zerotrain.planning.longest_sequence_report import describe_hardware, longest_sequence_report
    from zerotrain.planning.model_source import count_parameters
    from zerotrain.planning.rung_memory import Workload
    from zerotrain.train.data import DataError

    try:
        gpus_from = _resolve_gpu_count(args)
        per_node, assumed_cpu = _node_layout(args, "the longest sequence is what fits it")
        model = pa.load_model(args)
        base = pa.base_config(args)
        hardware = pa.hardware(per_node, args.gpus // per_node, args)
        workload = Workload(0, 1, pa.compute_dtype(args, base), args.attention, pa.loss_chunk_tokens(args),
                            pa.long_sequence(args, base))
        report = longest_sequence_report(model, hardware, workload, base, args.gradient_checkpointing)
        assumed = _assumed_lines(args, base, gpus_from, None)
    except (ConfigError, DataError, ValueError) as error:
        print_user_error("zerotrain plan", error)
        return USAGE_EXIT_CODE
    if args.json:
        print(json.dumps({"assumed": assumed, **report["json"]}, indent=2))
        return 0 if report["ok"] else 1
    total, _ = count_parameters(model)
    for line in assumed:
        print(line)
    _say_assumed_cpu(assumed_cpu)
    print(describe_hardware(args.model, total, hardware, workload) + report["text"], end="")
    return 0 if report["ok"] else 1


def _node_layout(args: argparse.Namespace, why_gpu_memory: str) -> tuple[int, int | None]:
    """GPUs per node, and the host memory per node assumed from this machine when --cpu-memory is not
    given (then set on `args`); ValueError for a GPU count that is not whole nodes or no --gpu-memory."""
    from zerotrain.planning import planning_args as pa

    per_node = args.gpus_per_node or min(args.gpus, 8)
    if args.gpus % per_node:
        raise ValueError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {per_node}")
    if args.gpu_memory is None:
        raise ValueError(f"--gpu-memory is required: {why_gpu_memory}, e.g. --gpu-memory 80GiB")
    # A plan never recommends what it did not check: without --cpu-memory, this machine's memory
    # is each node's (a rung offloading 1 TiB to a 64 GiB machine used to come out "fits").
    assumed_cpu = args.cpu_memory is None and pa.this_machine_memory()
    if assumed_cpu:
        args.cpu_memory = assumed_cpu
    return per_node, assumed_cpu or None


def _say_assumed_cpu(assumed_cpu: int | None) -> None:
    if assumed_cpu:
        from zerotrain.config.byte_sizes import format_bytes

        print(f"CPU memory per node: {format_bytes(assumed_cpu)}, this machine's (no --cpu-memory given; "
              "set it to plan for other nodes)")


def _assumed_lines(args: argparse.Namespace, base: dict | None, gpus_from: str | None,
                   batch_from: str | None) -> list[str]:
    """What the plan assumed that no flag said: the train YAML's ranks, precision and batch, the
    --scale count planned at, and a GPU memory written in GB (10^9 bytes)."""
    from zerotrain.planning import planning_args as pa

    parts = pa.assumed_from_train(args, base, gpus_from == "train") + ([batch_from] if batch_from else [])
    if gpus_from == "scale":
        parts.append(f"--gpus {args.gpus}, the smallest --scale count (the plan is made there)")
    lines = [pa.assumed_line(parts), pa.decimal_gpu_memory_note(args.gpu_memory)]
    return [line for line in lines if line]

