"""The one job every engine runs: a small Llama, synthetic token data, one optimizer recipe.

Everything here is a pure function of the harness arguments, so every engine
(and every rank) builds the same initial weights and sees the same batches.
"""

from __future__ import annotations

import argparse

import torch


def add_workload_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("workload (identical for every engine)")
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--intermediate", type=int, default=688)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--kv-heads", type=int, default=4)
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
    return g


def build_model(args) -> torch.nn.Module:
    """The Llama, built from a config (nothing downloaded), fp32, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model.float()


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
    h, i, v, L = args.hidden, args.intermediate, args.vocab, args.layers
    head_dim = h // args.heads
    attn = h * h * 2 + 2 * h * head_dim * args.kv_heads
    return L * (attn + 3 * h * i + 2 * h) + 2 * v * h + h
