"""`zerotrain estimate MODEL`: DeepSpeed's model-state memory estimates, before any run.

The model is built on the meta device (nothing loaded or downloaded, see `model_source`).
The default output is one compact table of DeepSpeed's ZeRO-2 and ZeRO-3 options, per GPU and
per CPU (node); `--deepspeed-format` prints DeepSpeed's own two tables, as
`estimate_zero2_model_states_mem_needs_all_live` / `estimate_zero3_..._all_live` do; `--json`
gives the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

_GIB = 2**30


def add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `estimate` to the `zerotrain` command."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate the memory a model needs per GPU and per CPU under each ZeRO option",
        description="Estimate the memory of a model's parameters, gradients and optimizer states under "
        "DeepSpeed's ZeRO-2 and ZeRO-3 options (DeepSpeed's estimator numbers), from the model's config "
        "on the meta device: no weights are loaded, nothing is downloaded.",
    )
    parser.add_argument(
        "model", metavar="MODEL",
        help="a local Hugging Face directory or config.json, a zerotrain train YAML, "
        "or an architecture name (llama, gpt2, ...) sized with --config-override",
    )
    parser.add_argument("--gpus-per-node", type=_positive_int, default=1, metavar="N", help="GPUs per node (default 1)")
    parser.add_argument("--nodes", type=_positive_int, default=1, metavar="N", help="nodes (default 1)")
    parser.add_argument(
        "--config-override", action="append", default=[], metavar="KEY=VALUE", dest="config_overrides",
        help="a model config value (as a train config's model.config_overrides), e.g. hidden_size=4096; repeatable",
    )
    parser.add_argument(
        "--additional-buffer-factor", type=float, default=1.5, metavar="F",
        help="DeepSpeed's safety factor on CPU memory (default 1.5)",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--deepspeed-format", action="store_true",
                        help="print DeepSpeed's own ZeRO-2 and ZeRO-3 tables (the guides' layout)")
    output.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.set_defaults(handler=run_estimate)


def run_estimate(args: argparse.Namespace) -> int:
    """Prints the estimate; returns 0, or 2 when MODEL cannot be built (the reason on stderr)."""
    from zerotrain.config.errors import ConfigError
    from zerotrain.error_report import USAGE_EXIT_CODE, print_user_error
    from zerotrain.planning.model_source import count_parameters, load_meta_model
    from zerotrain.train.data import DataError

    try:
        overrides = parse_config_overrides(args.config_overrides)
        model = load_meta_model(args.model, overrides)
    except (ConfigError, DataError, ValueError) as error:
        print_user_error("zerotrain estimate", error)
        return USAGE_EXIT_CODE
    total, largest = count_parameters(model)
    report = estimate_report(args.model, total, largest, args.gpus_per_node, args.nodes,
                             args.additional_buffer_factor)
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.deepspeed_format:
        from zerotrain.planning.deepspeed_estimates import format_zero2_table, format_zero3_table

        hw = (args.gpus_per_node, args.nodes, args.additional_buffer_factor)
        print(format_zero2_table(total, *hw), end="")
        print(format_zero3_table(total, largest, *hw), end="")
    else:
        print(format_compact(report), end="")
    return 0


def parse_config_overrides(items: list[str]) -> dict[str, Any]:
    """`["hidden_size=4096", "tie_word_embeddings=false"]` → a dict, values read as YAML scalars."""
    import yaml

    values: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--config-override {item!r}: expected KEY=VALUE, e.g. hidden_size=4096")
        values[key.strip()] = yaml.safe_load(text) if text.strip() else None
    return values


def estimate_report(model: str, total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int,
                    additional_buffer_factor: float = 1.5) -> dict[str, Any]:
    """The estimate as plain data: the model's counts, the hardware, and DeepSpeed's rows in bytes."""
    from zerotrain.planning.deepspeed_estimates import zero2_options, zero3_options

    hw = (gpus_per_node, nodes, additional_buffer_factor)
    return {
        "model": {"source": model, "total_params": total_params, "largest_layer_params": largest_layer_params},
        "hardware": {"nodes": nodes, "gpus_per_node": gpus_per_node},
        "additional_buffer_factor": additional_buffer_factor,
        "zero2": [row.as_dict() for row in zero2_options(total_params, *hw)],
        "zero3": [row.as_dict() for row in zero3_options(total_params, largest_layer_params, *hw)],
    }


def format_compact(report: dict[str, Any]) -> str:
    """One table of every ZeRO-2 and ZeRO-3 option, GiB per GPU and per CPU (node)."""
    model, hw = report["model"], report["hardware"]
    gpus = hw["gpus_per_node"]
    lines = [
        f"{model['source']}: {model['total_params']:,} parameters, largest layer {model['largest_layer_params']:,}",
        f"{hw['nodes']} node{'s' if hw['nodes'] > 1 else ''} x {gpus} GPU{'s' if gpus > 1 else ''}; "
        f"params, gradients and optimizer states (DeepSpeed's estimate, "
        f"CPU buffer factor {report['additional_buffer_factor']:g})",
        "",
        f"{'stage':<6}{'offload_param':<15}{'offload_optimizer':<19}{'zero_init':<11}{'per GPU':>11}{'per CPU':>12}",
    ]

    def line(stage: int, param: str, optimizer: str, init: str, row: dict[str, Any]) -> str:
        return (f"{stage:<6}{param:<15}{optimizer:<19}{init:<11}"
                f"{row['gpu_bytes'] / _GIB:>7.2f} GiB{row['cpu_bytes'] / _GIB:>8.2f} GiB")

    for row in report["zero2"]:
        lines.append(line(2, "-", "cpu" if row["offload_optimizer"] else "none", "-", row))
    for row in report["zero3"]:
        lines.append(line(3, "cpu" if row["offload_param"] else "none", "cpu" if row["offload_optimizer"] else "none",
                          "yes" if row["zero_init"] else "no", row))
    return "\n".join(lines) + "\n"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
