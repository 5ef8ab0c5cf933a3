"""The command-line flags `estimate`, `plan` and `init` share, and what they turn into.

MODEL and its `--config-override`s become a meta-device model; `--seq-len`, `--dtype`,
`--attention` a `Workload`; `--gpu-memory`, `--cpu-memory`, `--nvme` and the GPU counts a
`Hardware`; `--deepspeed` a base DeepSpeed config whose settings (optimizer, bucket sizes)
the estimate honours.
"""

from __future__ import annotations

import argparse
from typing import Any

from zerotrain.planning.rung_memory import Hardware, parse_size

DEFAULT_SEQ_LEN = 2048


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL",
        help="a local Hugging Face directory or config.json, a zerotrain train YAML, a model shipped "
        "with zerotrain (llama-3.2-1b, llama-2-7b, llama-3-70b), or an architecture name (llama, gpt2, ...) "
        "sized with --config-override",
    )
    parser.add_argument(
        "--config-override", action="append", default=[], metavar="KEY=VALUE", dest="config_overrides",
        help="a model config value (as a train config's model.config_overrides), e.g. hidden_size=4096; repeatable",
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq-len", type=positive_int, default=None, metavar="S",
                        help=f"tokens per sample (default: a train YAML's data.seq_len, else {DEFAULT_SEQ_LEN} "
                        "or the model's limit if smaller)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="compute dtype (default: the --deepspeed config's, else bf16)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="attention kernel: sdpa keeps no score matrix, eager keeps two per layer (default sdpa)")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="only rungs with (or, --no-gradient-checkpointing, without) activation "
                        "recomputation (default: both)")
    parser.add_argument("--loss-chunk-tokens", type=positive_int, default=None, metavar="N",
                        help="zerotrain train's chunked loss: the LM head and loss N tokens at a time, so the "
                        "full fp32 logits never exist (default: a train YAML's training.loss_chunk_tokens, else off)")
    parser.add_argument("--deepspeed", metavar="DS_CONFIG", default=None,
                        help="a DeepSpeed config whose optimizer, bucket sizes and stage-3 limits apply "
                        "(its stage and offload are what the rungs vary)")


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="memory of one GPU, e.g. 80GB (GB = GiB, as devices report it)")
    parser.add_argument("--cpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="CPU memory of one node, e.g. 512GB")
    parser.add_argument("--nvme", metavar="PATH", default=None,
                        help="a local NVMe folder: adds the NVMe offload rungs")


def load_model(args: argparse.Namespace):
    """The meta-device model MODEL names (ConfigError/ValueError for the caller to report)."""
    from zerotrain.planning.model_source import parse_config_overrides
    from zerotrain.planning.model_source import load_meta_model

    return load_meta_model(args.model, parse_config_overrides(args.config_overrides))


def base_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --deepspeed file as a dict (comments allowed, as DeepSpeed's loader allows)."""
    if not args.deepspeed:
        return None
    from pathlib import Path

    from zerotrain.config import load_config
    from zerotrain.config.loader import read_config_file

    path = Path(args.deepspeed)
    if not path.is_file():
        raise ValueError(f"--deepspeed {args.deepspeed}: no such file")
    data = read_config_file(path)
    load_config(data)  # validate now: a typo is reported against the file, not deep in an estimate
    return data


def compute_dtype(args: argparse.Namespace, base: dict[str, Any] | None) -> str:
    """--dtype, else the --deepspeed config's enabled bf16/fp16, else bf16."""
    if args.dtype:
        return args.dtype
    for key in ("bf16", "fp16"):
        if base and (base.get(key) or {}).get("enabled") in (True, "auto"):
            return key
    if base and base.get("bfloat16", {}).get("enabled") is True:
        return "bf16"
    return "bf16"


def train_yaml(args: argparse.Namespace):
    """MODEL's `zerotrain train` config when MODEL is one (its data and batch are defaults), else None."""
    if not str(args.model).endswith((".yaml", ".yml")):
        return None
    from pathlib import Path

    from zerotrain.train.config_files import load_train_config

    return load_train_config(Path(args.model))


def seq_len(args: argparse.Namespace, model) -> int:
    """--seq-len, else a train YAML's data.seq_len, else 2048 capped at the model's position limit."""
    if args.seq_len:
        return args.seq_len
    cfg = train_yaml(args)
    if cfg is not None:
        return cfg.data.seq_len
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    return min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN


def loss_chunk_tokens(args: argparse.Namespace) -> int | None:
    """--loss-chunk-tokens, else a train YAML's training.loss_chunk_tokens, else None (the model's own loss)."""
    if getattr(args, "loss_chunk_tokens", None):
        return args.loss_chunk_tokens
    cfg = train_yaml(args)
    return cfg.training.loss_chunk_tokens if cfg is not None else None


def hardware(gpus_per_node: int, nodes: int, args: argparse.Namespace) -> Hardware:
    return Hardware(gpus_per_node, nodes, args.gpu_memory, args.cpu_memory, args.nvme)


def this_machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def memory_size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
