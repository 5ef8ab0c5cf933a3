"""A tiny Llama (SDPA) and one global batch, trained one SGD step at sp = 1 (plain torch) or with
Ulysses sequence parallelism by the engine; the weight change is the gradient, times the LR.

The batch has four rows, each a hard case for the split:
- row 0: two packed documents (tokens 0-9 and 10-15: position_ids restart at 10, inside a slice);
- row 1: right padding over its last 4 tokens (attention_mask 0, labels -100);
- rows 2, 3: labels -100 from token 9 on;
and every row has labels -100 on tokens 5-8. So after the shift no row has a target on 4-7 (sp 4:
rank 1 has no valid token at all) and rows 2-3 none on 8-15 (sp 2 x dp 2: the second group's
rank 1 has none).
"""

from __future__ import annotations

import torch

VOCAB, SEQ, ROWS = 64, 16, 4
LR = 1024.0  # a power of two: (w0 - w1) / LR is the gradient, to fp32 rounding of LR * grad


def make_model(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
        attn_implementation="sdpa", use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def global_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    positions = torch.arange(SEQ).repeat(ROWS, 1)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    positions[0, 10:] = torch.arange(SEQ - 10)
    mask[1, 12:] = 0
    labels[1, 12:] = -100
    labels[:, 5:9] = -100
    labels[2:4, 9:] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


def _row_loss_sum(model, batch: dict, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of one row and its target count, at sp = 1: the packed row
    with its position_ids (transformers masks per document), the padded row with its mask."""
    ids = batch["input_ids"][row : row + 1]
    kwargs = {"position_ids": batch["position_ids"][row : row + 1]}
    if not bool(batch["attention_mask"][row].all()):
        kwargs = {"attention_mask": batch["attention_mask"][row : row + 1]}
    logits = model(input_ids=ids, **kwargs).logits.float()
    targets = batch["labels"][row, 1:]
    total = torch.nn.functional.cross_entropy(logits[0, :-1], targets, ignore_index=-100, reduction="sum")
    return total, (targets != -100).sum()


def reference_step(kv_heads: int, sp: int, world: int, gas: int = 1) -> tuple[list[list[float]], dict]:
    """sp = 1: per data-parallel group and micro-step, the token-weighted mean over its rows; the
    average over groups and micro-steps' gradient; one SGD step. Returns each group's micro-step
    losses and the gradients ((w0 - w1) / LR)."""
    model = make_model(kv_heads)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp = world // sp
    batch, micro = global_batch(), ROWS // (dp * gas)
    losses = []
    for group in range(dp):
        losses.append([])
        for step in range(gas):
            first = (group * gas + step) * micro
            parts = [_row_loss_sum(model, batch, r) for r in range(first, first + micro)]
            loss = sum(t for t, _ in parts) / sum(c for _, c in parts)
            (loss / (dp * gas)).backward()
            losses[-1].append(loss.item())
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return losses, {n: (w0[n] - p.detach()) / LR for n, p in model.named_parameters()}


def engine_step(kv_heads: int, sp: int, stage: int, offload: dict | None = None, gas: int = 1,
                dtype: str = "fp32") -> dict:
    """This rank's part of one engine step at sequence_parallel_size `sp` over `gas` micro-steps: its
    micro-step losses and the gradients ((w0 - w1) / LR, gathered whole)."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.sequence import (
        SequenceParallelError, sequence_parallel_loss, shard_batch, uninstall_ulysses_attention,
    )
    from zerotrain.zero import GatheredParameters

    model = make_model(kv_heads)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero = {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
            "stage3_param_persistence_threshold": 0, **(offload or {})}
    config = {
        "train_batch_size": ROWS, "gradient_accumulation_steps": gas, "sequence_parallel_size": sp,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": zero, "steps_per_print": 1000,
        **({dtype: {"enabled": True}} if dtype != "fp32" else {}),
    }
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    groups = engine.sequence_groups
    micro = engine.train_micro_batch_size_per_gpu()
    losses, local_targets, missing_positions = [], 0, "accepted"
    for step in range(gas):
        first = (groups.data_parallel_rank * gas + step) * micro
        local = shard_batch({k: v[first : first + micro] for k, v in global_batch().items()}, groups.rank, sp)
        targets = local.pop("shift_labels")
        if step == 0:
            try:
                engine(input_ids=local["input_ids"])
            except SequenceParallelError as error:
                missing_positions = str(error)
        loss = sequence_parallel_loss(engine(**local).logits, targets, groups.sequence_group)
        engine.backward(loss)
        engine.step()  # a step only at the last micro-step
        losses.append(loss.item())
        local_targets += int((targets != -100).sum())
    with GatheredParameters(list(engine.module.parameters())):
        grads = {n: (w0[n] - p.detach().float()) / LR for n, p in engine.module.named_parameters()}
    uninstall_ulysses_attention("sdpa")
    engine.destroy()
    dist.barrier()
    return {"losses": losses, "grads": grads, "dp_rank": groups.data_parallel_rank,
            "local_targets": local_targets, "missing_positions": missing_positions}


def loss_with_no_target() -> dict:
    """The group loss and gradient when no rank of the group has a target (all -100)."""
    from zerotrain.sequence import current_groups, sequence_parallel_loss

    logits = torch.randn(2, 4, VOCAB, requires_grad=True)
    loss = sequence_parallel_loss(logits, torch.full((2, 4), -100), current_groups().sequence_group)
    loss.backward()
    return {"loss": loss.item(), "grad_finite": bool(logits.grad.isfinite().all())}
