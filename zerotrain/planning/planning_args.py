"""The command-line flags `estimate`, `plan` and `init` share, and what they turn into.

MODEL and its `--config-override`s become a meta-device model; `--seq-len`, `--dtype`,
`--attention` a `Workload`; `--gpu-memory`, `--cpu-memory`, `--nvme` and the GPU counts a
`Hardware`; `--deepspeed` a base DeepSpeed config whose settings (optimizer, bucket sizes)
the estimate honours.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from zerotrain.config.byte_sizes import parse_byte_size

if TYPE_CHECKING:  # rung_memory imports torch: the parsers are built without it (`zerotrain --help`)
    from zerotrain.planning.activation_memory import LongSequence
    from zerotrain.planning.rung_memory import Hardware

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
    parser.add_argument("--sequence-parallel", type=positive_int, default=None, metavar="N",
                        help="Ulysses sequence parallelism: N ranks share each sequence, each holding 1/N of it "
                        "(DeepSpeed's sequence_parallel_size; default: a train YAML's, else 1)")
    parser.add_argument("--tiled-mlp", nargs="?", const=True, default=None, type=positive_int, metavar="TOKENS",
                        help="the MLP run a tile of tokens at a time, recomputed in backward (training.tiled_mlp); "
                        "alone: DeepSpeed's tiles as long as the model is wide; TOKENS: tokens per tile "
                        "(default: a train YAML's, else off)")
    parser.add_argument("--offload-activations", action=argparse.BooleanOptionalAction, default=None,
                        help="checkpointed layers' inputs kept in CPU memory until their recompute "
                        "(training.offload_activations; only rungs with checkpointing; default: a train YAML's, else off)")
    parser.add_argument("--deepspeed", metavar="DS_CONFIG", default=None,
                        help="a DeepSpeed config whose optimizer, bucket sizes and stage-3 limits apply "
                        "(its stage and offload are what the rungs vary)")


def add_max_seq_len_flag(parser: argparse.ArgumentParser) -> None:
    """`--max-seq-len`, shared by estimate and plan (longest_sequence_report.py answers it)."""
    parser.add_argument("--max-seq-len", action="store_true",
                        help="answer the longest sequence (micro-batch 1) this model trains on these GPUs with "
                        "the long-sequence switches given (--sequence-parallel, --tiled-mlp, --offload-activations, "
                        "--loss-chunk-tokens), what to switch on to go longer, and the train YAML that runs it")


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="memory of one GPU, e.g. 80GiB for an 80 GB H100 (GiB = 2^30 bytes, as devices "
                        "report it; GB = 10^9 bytes, so 80GB is 74.5 GiB)")
    parser.add_argument("--cpu-memory", type=memory_size, default=None, metavar="SIZE",
                        help="CPU memory of one node, e.g. 512GiB (GiB = 2^30 bytes, GB = 10^9)")
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
    """--dtype, else the --deepspeed config's enabled bf16/fp16, else a train YAML's precision as
    `zerotrain train` resolves it here, else bf16."""
    given = _given_dtype(args, base)
    if given:
        return given
    run = train_run(args)
    return run.dtype if run is not None else "bf16"


def _given_dtype(args: argparse.Namespace, base: dict[str, Any] | None) -> str | None:
    """--dtype, else the --deepspeed config's enabled bf16/fp16 (None: neither says)."""
    if args.dtype:
        return args.dtype
    for key in ("bf16", "fp16"):
        if base and (base.get(key) or {}).get("enabled") in (True, "auto"):
            return key
    if base and base.get("bfloat16", {}).get("enabled") is True:
        return "bf16"
    return None


def train_run(args: argparse.Namespace):
    """What `zerotrain train MODEL` would run here (AssumedTrainRun) when MODEL is a train YAML, else None."""
    cfg = train_yaml(args)
    if cfg is None:
        return None
    from zerotrain.planning.assumed_train_run import assumed_train_run

    return assumed_train_run(cfg)


def assumed_from_train(args: argparse.Namespace, base: dict[str, Any] | None, ranks_from_train: bool) -> list[str]:
    """What was taken from `zerotrain train` for a train YAML (its ranks, its precision), for the
    "assumed: ..." line; empty when MODEL is no train YAML or flags said both."""
    run = train_run(args)
    if run is None:
        return []
    return run.describe(ranks=ranks_from_train, dtype=_given_dtype(args, base) is None)


def assumed_line(parts: list[str]) -> str | None:
    """ "assumed: a, b" (None for no parts): what a planner took that no flag said."""
    return "assumed: " + ", ".join(parts) if parts else None


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


def long_sequence(args: argparse.Namespace, base: dict[str, Any] | None = None) -> LongSequence:
    """--sequence-parallel, --tiled-mlp, --offload-activations, each else a train YAML's setting (training.*,
    or its DeepSpeed section's sequence_parallel_size), else the --deepspeed config's sequence_parallel_size, else off."""
    from zerotrain.planning.activation_memory import LongSequence

    cfg = train_yaml(args)
    if cfg is not None:
        yaml = LongSequence.of_train_config(cfg)
    else:
        yaml = LongSequence(int((base or {}).get("sequence_parallel_size") or 1))
    sp = args.sequence_parallel or yaml.sequence_parallel
    tiled = args.tiled_mlp if args.tiled_mlp is not None else yaml.tiled_mlp
    offload = args.offload_activations if args.offload_activations is not None else yaml.offload_activations
    return LongSequence(int(sp), tiled, offload)


def hardware(gpus_per_node: int, nodes: int, args: argparse.Namespace) -> Hardware:
    from zerotrain.planning.rung_memory import Hardware

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
    """A --gpu-memory/--cpu-memory value in bytes, by the one size rule (config/byte_sizes.py); a unit is required."""
    try:
        return parse_byte_size(text, require_unit=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def decimal_gpu_memory_note(gpu_memory: int | None) -> str | None:
    """A note when --gpu-memory was written in GB (10^9 bytes): GPUs count memory in GiB, so an
    "80GB" card holds about 80 GiB and 80GB undercounts it by 7%. None otherwise."""
    if not gpu_memory or gpu_memory % 10**9 or gpu_memory % 2**30 == 0:
        return None
    from zerotrain.config.byte_sizes import format_bytes

    gb = gpu_memory // 10**9
    return (f"GPU memory: {gb}GB is {gb}e9 bytes = {format_bytes(gpu_memory)} (GB = 10^9 bytes); a GPU sold as "
            f"{gb} GB holds about {gb} GiB: write --gpu-memory {gb}GiB for it")
