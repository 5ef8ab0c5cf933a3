"""A tiny Llama and its data, trained by plain torch (the reference) or by zerotrain.

Shared by the parity, memory and communication tests. Everything is seeded so a
reference run and a distributed run see the same weights and the same global batches.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR, CLIP = 64, 16, 8, 10, 1e-2, 1.0


def make_model(tied: bool = False, extra_unused: bool = False, freeze_one: bool = False, seed: int = 0,
               checkpointing: bool | str = False, loss_chunk_tokens: int | None = None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    model = LlamaForCausalLM(cfg)
    if extra_unused:
        model.unused_head = nn.Linear(32, 8)  # never called in forward
    if freeze_one:
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    if checkpointing:
        from zerotrain.runtime.activation_checkpointing import enable_gradient_checkpointing

        enable_gradient_checkpointing(model, checkpointing)
    if loss_chunk_tokens:
        from zerotrain.runtime.chunked_loss import enable_chunked_loss

        enable_chunked_loss(model, loss_chunk_tokens)
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups, as users write them: no weight decay on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def global_batch(step: int) -> torch.Tensor:
    """Learnable sequences: start, start+s, start+2s, ... (mod VOCAB), a fresh batch each step."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    strides = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (starts + strides * torch.arange(SEQ)) % VOCAB


def reference_device(device: str) -> torch.device:
    """Where a test case's plain-torch reference trains: its GPU for a "gpu" case when there is one
    (a dry GPU check has none: its "gpu" cases run on the CPU, as the engine does then)."""
    return torch.device("cuda") if device == "gpu" and torch.cuda.is_available() else torch.device("cpu")


def train_reference(steps: int = STEPS, device: str = "cpu", wrap=None, **model_kwargs) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch.optim.AdamW on the whole global batch; weights returned on the CPU.
    `wrap(model)` may replace the built model first (e.g. with PEFT's LoRA model)."""
    where = reference_device(device)
    model = make_model(**model_kwargs)
    model = (wrap(model) if wrap else model).to(where)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = []
    for step in range(steps):
        ids = global_batch(step).to(where)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def zero_config(stage: int, world: int, gas: int, dtype: str = "fp32", **zero_extra) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        # Small buckets so every stage exercises several buckets and their overlap.
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
            # stage 3: shard every parameter (the tiny model is all below the default threshold)
            # and prefetch the next unit
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 20000,
            **zero_extra,
        },
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_zerotrain(config: dict, steps: int = STEPS, compile: dict | None = None, wrap=None, zero_init: bool = False,
                    **model_kwargs) -> dict:
    """This rank's part of a zerotrain run: its micro-batch losses per step and final weights.
    `compile`: the arguments of an `engine.compile(...)` call made before training; `wrap` as in
    `train_reference`; `zero_init`: the model is built inside `zerotrain.zero.Init()`."""
    import torch.distributed as dist

    import zerotrain

    if zero_init:
        from zerotrain.comm.distributed import init_distributed

        init_distributed()  # zero.Init shards as it builds: the ranks must exist first
    with zerotrain.zero.Init(enabled=zero_init):
        model = make_model(**model_kwargs)
    model = wrap(model) if wrap else model
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    if compile is not None:
        engine.compile(**compile)
    world, rank = dist.get_world_size(), dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(steps):
        ids = global_batch(step)
        step_losses = []
        for m in range(gas):
            # Global batch split as [micro-step][rank][micro batch], so ranks x micro-steps cover it once.
            start = (m * world + rank) * micro
            chunk = ids[start : start + micro].to(engine.device)
            loss = engine(input_ids=chunk, labels=chunk).loss
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / gas)
    from zerotrain.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # whole under stage 3 too
        weights = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "weights": weights, "engine": engine}
