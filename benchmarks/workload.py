"""The one job every engine runs: a small Llama, synthetic token data, one optimizer recipe.

Everything here is a pure function of the harness arguments, so every engine
(and every rank) builds the same initial weights and sees the same batches.
"""

from __future__ import annotations

import argparse

import torch


# Model sizes: flag dest -> (LlamaConfig field, the built-in small job's value). A flag left out
# takes the value from --model-config when one is given, else the built-in value.
SIZE_FIELDS = {
    "vocab": ("vocab_size", 4096),
    "hidden": ("hidden_size", 256),
    "intermediate": ("intermediate_size", 688),
    "layers": ("num_hidden_layers", 4),
    "heads": ("num_attention_heads", 8),
    "kv_heads": ("num_key_value_heads", 4),
}


def add_workload_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("workload (identical for every engine)")
    g.add_argument("--model-config", default=None,
                   help="a transformers LlamaConfig JSON (e.g. benchmarks/gpu/llama-1b.json); its sizes replace the "
                        "built-in ones, the size flags below still override them")
    for dest, (field_name, value) in SIZE_FIELDS.items():
        g.add_argument("--" + dest.replace("_", "-"), dest=dest, type=int, default=None,
                       help=f"{field_name} (default: --model-config's, else {value})")
    g.add_argument("--seq", type=int, default=128)
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip", type=float, default=1.0, help="gradient clipping (global L2 norm)")
    g.add_argument("--seed", type=int, default=0, help="model init and data seed")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    g.add_argument(
        "--bucket-numel", type=int, default=500_000_000,
        help="reduce/allgather bucket size (elements) for zerotrain and DeepSpeed (their shared default)",
    )
    g.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing (non-reentrant) on every decoder layer, for every engine")
    g.add_argument("--init-device", choices=["cpu", "device"], default="cpu",
                   help="where the model is built and initialized: the CPU, or directly on the rank's device "
                        "(seeded either way, so every engine starts from the same weights; the two differ)")
    return g


def resolve_sizes(args) -> None:
    """Fills the size flags left out (None) from --model-config, else the built-in values. Idempotent."""
    file_cfg = _file_config(args)
    for dest, (field_name, value) in SIZE_FIELDS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, getattr(file_cfg, field_name) if file_cfg is not None else value)


def _file_config(args):
    path = getattr(args, "model_config", None)
    if not path:
        return None
    from transformers import LlamaConfig

    return LlamaConfig.from_json_file(path)


def llama_config(args):
    """The LlamaConfig every engine builds: --model-config's (or defaults) with the size flags applied."""
    from transformers import LlamaConfig

    resolve_sizes(args)
    sizes = {field_name: getattr(args, dest) for dest, (field_name, _) in SIZE_FIELDS.items()}
    cfg = _file_config(args)
    if cfg is None:
        cfg = LlamaConfig(**sizes, max_position_embeddings=args.seq, tie_word_embeddings=False,
                          attn_implementation="sdpa")
    else:
        for key, value in sizes.items():
            setattr(cfg, key, value)
        # A head width derived from the sizes, so shrunken sizes (the dry runs) stay consistent.
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.seq)
        cfg._attn_implementation = "sdpa"  # the fused kernels (flash / memory-efficient on a GPU)
    cfg.use_cache = False
    return cfg


def build_model(args, device=None) -> torch.nn.Module:
    """The Llama, built from a config (nothing downloaded), fp32, seeded.

    device: where its parameters are created and initialized (default the CPU). The same seed
    gives the same weights on every run on that device type, hence for every engine of a run.
    With args.checkpointing, activation checkpointing is switched on (`enable_checkpointing`).
    """
    from transformers import LlamaForCausalLM

    cfg = llama_config(args)
    torch.manual_seed(args.seed)
    with torch.device(device if device is not None else "cpu"):
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    if getattr(args, "checkpointing", False):
        enable_checkpointing(model)
    return model.float()


def model_device(args) -> torch.device | None:
    """The device `build_model` should build on: None (the CPU) unless --init-device device."""
    if getattr(args, "init_device", "cpu") != "device" or not torch.cuda.is_available():
        return None
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of each decoder layer, as `zerotrain train` sets it
    (zerotrain/train/model.py; repeated here so DeepSpeed's and torch's processes import no zerotrain).

    Non-reentrant: it works with ZeRO-3's and FSDP2's hooks and with inputs that need no gradient.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers; older has only the old name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def rank_batch(args, step: int, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s micro batch of the global batch of `step`.

    Tokens are drawn from a Zipf(1.1) law over the vocabulary: a model that trains
    shows its loss falling from ln(vocab) toward the law's entropy (about 5.5 for
    vocab 4096) within a few dozen steps, so "it trained" is visible in a short run.
    """
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    n = world * args.micro_batch
    weights = 1.0 / torch.arange(1, args.vocab + 1, dtype=torch.float64) ** 1.1
    batch = torch.multinomial(weights, n * args.seq, replacement=True, generator=g).view(n, args.seq)
    return batch[rank * args.micro_batch : (rank + 1) * args.micro_batch].contiguous()


def optimizer_kwargs(args) -> dict:
    """torch.optim.AdamW's arguments, shared by every engine (foreach set explicitly: its default differs)."""
    return {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": args.weight_decay, "foreach": True}


def ds_config(args, stage: int, offload: bool = False, cpu_adam: bool = False) -> dict:
    """The DeepSpeed-format config, used verbatim by zerotrain and by DeepSpeed.

    `torch_adam` makes DeepSpeed build torch.optim.AdamW (no compiled ops), the
    optimizer zerotrain builds for "AdamW" and the baselines use. It does so with
    offload too: DeepSpeed's "ZeRO-Offload needs DeepSpeedCPUAdam" check
    (`zero_force_ds_cpu_optimizer`) applies only to optimizers passed to
    `initialize`, not to one its config builds, so both engines step the same
    torch.optim.AdamW over their CPU shards.

    offload: `offload_optimizer {device: cpu}` (master weights and optimizer state on
    the CPU, stages 1-3), plus `offload_param {device: cpu}` at stage 3.
    cpu_adam: leave out `torch_adam`, so DeepSpeed with offload builds its
    DeepSpeedCPUAdam (AdamW maths in a JIT-built C++/OpenMP op): DeepSpeed's
    default offload path, run as a reference column.
    """
    opt = optimizer_kwargs(args)
    params = {
        "lr": opt["lr"], "betas": list(opt["betas"]), "eps": opt["eps"], "weight_decay": opt["weight_decay"],
        "adam_w_mode": True,
    }
    if not cpu_adam:  # DeepSpeedCPUAdam takes no `foreach`
        params.update(foreach=opt["foreach"], torch_adam=True)
    zero = {"stage": stage, "reduce_bucket_size": args.bucket_numel, "allgather_bucket_size": args.bucket_numel}
    if getattr(args, "persistence_threshold", None) is not None:  # stage 3: shard even small parameters
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def param_count(args) -> int:
    """Parameters of the model `build_model` makes, computed without building it."""
    resolve_sizes(args)
    h, i, v, L = args.hidden, args.intermediate, args.vocab, args.layers
    head_dim = h // args.heads
    attn = h * h * 2 + 2 * h * head_dim * args.kv_heads
    file_cfg = _file_config(args)
    tied = bool(file_cfg is not None and file_cfg.tie_word_embeddings)
    return L * (attn + 3 * h * i + 2 * h) + (1 if tied else 2) * v * h + h
