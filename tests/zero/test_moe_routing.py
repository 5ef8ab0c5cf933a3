"""A mixture-of-experts layer whose two ranks route their tokens to disjoint experts.

Rank 0's tokens all choose experts 0 and 1, rank 1's experts 2 and 3 (a large input channel the
router reads, forced per sample), so every expert is unused on one rank: its parameters get no
gradient there, and at stage 3 it does not run there. At stages 2 and 3, with and without CPU
offload, training must neither hang nor mis-reduce: every parameter's reduced gradient (all
ranks' shards gathered) equals the single-process gradient of the global batch. The experts are
a ModuleList of modules run only when chosen (DeepSpeed's MoE, transformers 4's Mixtral);
transformers 5's fused expert tensors always get a gradient, see tests/hf/test_moe_trainer.py.

The one-layer model's largest ModuleList is its experts: stage 3 would make each expert a unit,
gathered only on the rank that runs it, so rank 0's gather of expert 0 met rank 1's of expert 2
(same size: no error, silently wrong weights and gradients; sizes that differ would hang). With
the block flagged by `set_z3_leaf_modules` no unit lies inside it: it is gathered whole.

Tolerance: fp32, rtol 1e-5 (atol 1e-7 for entries that cancel to ~0): the ranks' halves are
summed in another order than the single-process batch, nothing else differs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # starts processes: `make test`, not `make check`

HIDDEN, EXPERTS, TOP_K = 16, 4, 2
SAMPLES_PER_RANK, TOKENS = 2, 6
ROUTE_SIGNAL = 8.0  # input channel 0: +8 on rank 0's samples, -8 on rank 1's
ROUTER_PULL = 2.0  # router weight on channel 0: +2 for experts 0-1, -2 for 2-3 (logit gap 32 >> the rest)
RTOL, ATOL = 1e-5, 1e-7

# (name, stage, zero_optimization extras, one layer?, leaf flagged?)
CASES = [
    (f"stage{stage}{'-offload' if offload else ''}-{shape}{'' if leaf else '-noleaf'}", stage, offload, shape, leaf)
    for stage in (2, 3)
    for offload in (False, True)
    for shape, leaf in (("layers", True), ("one-layer", True), ("layers", False))
    if leaf or (stage == 3 and not offload)  # units are whole layers: no leaf needed (shown once)
]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-2 routing; an expert no token chose is not run (as Hugging Face's expert loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        with torch.no_grad():
            self.router.weight[:, 0] = torch.tensor([ROUTER_PULL, ROUTER_PULL, -ROUTER_PULL, -ROUTER_PULL])
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.ran: set[int] = set()  # experts run in this process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            self.ran.add(e)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return x + out


class MoEModel(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        if layers == 1:
            self.moe = MoEBlock()
        else:
            self.layers = nn.ModuleList(MoEBlock() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, 1)

    def blocks(self) -> list[MoEBlock]:
        return [self.moe] if hasattr(self, "moe") else list(self.layers)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, HIDDEN)
        for block in self.blocks():
            x = block(x)
        return torch.nn.functional.mse_loss(self.head(x).squeeze(-1), target.reshape(-1))


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """2 ranks x SAMPLES_PER_RANK samples; rank r's samples carry the route signal of rank r."""
    g = torch.Generator().manual_seed(1)
    samples = 2 * SAMPLES_PER_RANK
    x = torch.randn(samples, TOKENS, HIDDEN, generator=g)
    x[:, :, 0] = torch.tensor([ROUTE_SIGNAL] * SAMPLES_PER_RANK + [-ROUTE_SIGNAL] * SAMPLES_PER_RANK)[:, None]
    return x, torch.randn(samples, TOKENS, generator=g)


def build_model(one_layer: bool) -> MoEModel:
    torch.manual_seed(0)
    return MoEModel(1 if one_layer else 2)


def reference_gradients(one_layer: bool) -> dict[str, torch.Tensor]:
    """Single process, the global batch, plain torch."""
    model = build_model(one_layer)
    model(*global_batch()).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reduced_gradients(engine) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient, whole: each bucket's gradient shards gathered from all ranks."""
    import torch.distributed as dist

    out = {}
    for fp in engine.flat_params:
        shard = fp.grad_of_shard().detach().float().cpu().contiguous()
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        whole = torch.cat(parts) if fp.sharded else shard
        for name, offset, numel, shape in zip(fp.names, fp.offsets, fp.numels, fp.shapes):
            out[name] = whole[offset : offset + numel].view(shape).clone()
    return out


def _all_cases() -> dict:
    import sys

    import torch.distributed as dist

    import zerotrain
    from zerotrain.compat.deepspeed_standin import STANDIN_DIR

    sys.path.insert(0, str(STANDIN_DIR))  # `deepspeed` is zerotrain's stand-in, as under `zerotrain launch`
    from deepspeed.utils import set_z3_leaf_modules

    zerotrain.init_distributed()
    rank = dist.get_rank()
    x, target = global_batch()
    mine = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    out = {}
    for name, stage, offload, shape, leaf in CASES:
        model = build_model(shape == "one-layer")
        if leaf:
            set_z3_leaf_modules(model, [MoEBlock])  # as LLaMA-Factory does before the engine wraps the model
        zero = {"stage": stage, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": SAMPLES_PER_RANK, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": zero}
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
        for step in range(2):  # the second: stage 3's recorded order and prefetch
            engine.backward(engine(x[mine], target[mine]))
            grads = reduced_gradients(engine)
            engine.step()
            if step == 0:
                out[name] = {"grads": grads, "ran": [sorted(b.ran) for b in model.blocks()],
                             "buckets": len(engine.flat_params)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, _all_cases, timeout=180)  # a hang fails here, after 180 s


def test_the_two_ranks_route_to_disjoint_experts(ranks):
    for name, *_ in CASES:
        rank0, rank1 = (r[name]["ran"] for r in ranks)
        assert all(ran == [0, 1] for ran in rank0), f"{name}: rank 0 ran experts {rank0}"
        assert all(ran == [2, 3] for ran in rank1), f"{name}: rank 1 ran experts {rank1}"
    # Stage 2 cuts the experts into several buckets, launched in a fixed order whatever a rank left unused
    assert all(ranks[0][name]["buckets"] > 2 for name, stage, *_ in CASES if stage == 2)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_expert_gets_the_gradient_of_the_global_batch(ranks, case):
    one_layer = "one-layer" in case
    expected = reference_gradients(one_layer)
    for rank, result in enumerate(ranks):
        grads = result[case]["grads"]
        assert sorted(grads) == sorted(expected)
        for name, want in expected.items():
            assert want.abs().max() > 0, f"{name}: the reference gradient is zero, the check would prove nothing"
            torch.testing.assert_close(grads[name], want, rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank}, {name}: {m}")
