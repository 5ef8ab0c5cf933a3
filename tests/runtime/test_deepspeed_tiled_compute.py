"""DeepSpeed's ALST tiled compute on zerotrain (compat/tiled_compute.py, compat/tiled_logits_loss.py):
`TiledFusedLogitsLoss`, `sequence_tiled_compute` and `TiledMLP` give the untiled loss and gradients,
each parameter's gradient is accumulated once (zerotrain's reducer reduces on that one accumulation),
and ZeRO-2/3 training on 2 ranks with the tiled loss equals one process on the global batch.

Equality: losses and activations' gradients are per-token computations, equal up to the order of
fp32 sums; a weight's gradient is the sum of the tiles' partial matmuls (fp32 rounding).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import run_on_ranks
from llama_workload import CLIP, LR, VOCAB, global_batch, make_model, param_groups, zero_config
from zerotrain.compat.tiled_compute import TiledMLP, sequence_tiled_compute
from zerotrain.compat.tiled_logits_loss import TiledFusedLogitsLoss

TOKENS, SHARDS = 20, 3  # 20 tokens in tiles of 7: the last tile short


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :7] = -100  # a masked stretch, longer than a whole tile on the first row
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _summed_ce(model: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-100, reduction="sum")


def _tiled_loss(model: nn.Module, ids: torch.Tensor, how: str) -> torch.Tensor:
    """The token-mean loss of `ids`, its summed cross-entropy computed the way `how` names."""
    hidden = model.model(input_ids=ids).last_hidden_state
    shift = _shifted(ids)
    if how == "untiled":
        summed = _summed_ce(model, hidden, shift)
    elif how == "fused":
        summed = TiledFusedLogitsLoss.apply(_summed_ce, model, hidden, shift, None, SHARDS, [model.lm_head.weight], "sum")
    else:  # ArcticTraining's call: the model passed along, the loss of each tile stacked and summed
        summed = sequence_tiled_compute(
            lambda hidden_states, shift_labels, model: _summed_ce(model, hidden_states, shift_labels),
            ids.shape[1], SHARDS, {"hidden_states": hidden, "shift_labels": shift}, {"model": model},
            "hidden_states", [model.lm_head.weight], output_unshard_dimension=0, output_reduction="sum")
    return summed / (shift != -100).sum()


def _loss_grads_and_accumulations(model: nn.Module, ids: torch.Tensor, how: str):
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    loss = _tiled_loss(model, ids, how)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls


def _assert_same(grads: dict, ref: dict) -> None:
    for name, expected in ref.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("how", ["fused", "sequence_tiled"])
def test_tiled_loss_gives_the_untiled_loss_and_gradients_accumulating_each_once(how):
    model = make_model()
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads, _ = _loss_grads_and_accumulations(copy.deepcopy(model), ids, "untiled")
    loss, grads, calls = _loss_grads_and_accumulations(model, ids, how)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    _assert_same(grads, ref_grads)
    assert calls == {name: 1 for name in ref_grads}


def test_fused_logits_loss_mean_is_the_mean_of_the_tiles_made_with_a_mask():
    # 2 x 5 tokens in 4 shards: torch.chunk makes 3 tiles (4, 4, 2), so "mean" divides by 3, not 4.
    torch.manual_seed(0)
    head = nn.Linear(6, 5)
    x = torch.randn(2, 5, 6, requires_grad=True)
    y = torch.randint(0, 5, (2, 5))
    mask = torch.rand(2, 5) > 0.3

    def tile_loss(owner, x_tile, y_tile, mask_tile):
        return (F.cross_entropy(owner(x_tile), y_tile, reduction="none") * mask_tile).sum()

    loss = TiledFusedLogitsLoss.apply(tile_loss, head, x, y, mask, 4, [head.weight, head.bias], "mean")
    (loss * 3.0).backward()  # an incoming gradient other than 1 scales every gradient
    tiled = (x.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    x.grad = head.weight.grad = head.bias.grad = None
    rows = [t.reshape(-1, 6) for t in (x,)][0]
    parts = zip(rows.chunk(4), y.reshape(-1).chunk(4), mask.reshape(-1).chunk(4))
    ref = torch.stack([tile_loss(head, a, b, c) for a, b, c in parts]).mean()
    (ref * 3.0).backward()
    torch.testing.assert_close(loss, ref.detach())
    for got, expected in zip(tiled, (x.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_sequence_tiled_compute_of_an_mlp_matches_untiled_and_recomputes_with_the_forward_dropout():
    # Output on dim 1, no reduction (the MLP case); dropout masks of the recompute equal the forward's,
    # so the gradient is that of the output returned. A passed tensor that requires grad gets one too.
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 8))
    x = torch.randn(2, 10, 8, requires_grad=True)
    scale = torch.randn(8, requires_grad=True)
    weights = torch.randn(2, 10, 8)

    def fn(x, scale, mlp):
        return mlp(x) * scale

    torch.manual_seed(5)
    out = sequence_tiled_compute(fn, 10, 4, {"x": x}, {"scale": scale, "mlp": mlp}, "x", None, 1, None)
    (out * weights).sum().backward()
    tiled = [t.grad.clone() for t in (x, scale, *mlp.parameters())]
    for t in (x, scale, *mlp.parameters()):
        t.grad = None
    torch.manual_seed(5)  # the same draws in the same order: tile by tile
    ref = torch.cat([fn(x[:, s : s + 3], scale, mlp) for s in range(0, 10, 3)], dim=1)
    (ref * weights).sum().backward()
    torch.testing.assert_close(out, ref.detach())
    for got, t in zip(tiled, (x, scale, *mlp.parameters())):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-7)


def test_sequence_tiled_compute_mean_over_elements_gives_the_untiled_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(1, 9, 4, requires_grad=True)
    out = sequence_tiled_compute(lambda x, lin: lin(x), 9, 2, {"x": x}, {"lin": lin}, "x", [lin.weight, lin.bias])
    out.backward()
    tiled = [t.grad.clone() for t in (x, lin.weight, lin.bias)]
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    ref = lin(x).mean()
    ref.backward()
    torch.testing.assert_close(out, ref.detach())
    for got, t in zip(tiled, (x, lin.weight, lin.bias)):
        torch.testing.assert_close(got, t.grad)


def test_deepspeed_tiled_mlp_matches_untiled_and_accumulates_once():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
    x = torch.randn(2, 11, 8, requires_grad=True)
    calls = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    TiledMLP.apply(lambda self, tile: self(tile), mlp, x, 4, None).pow(2).sum().backward()
    tiled = [t.grad.clone() for t in (x, *mlp.parameters())]
    assert len(calls) == 4
    for t in (x, *mlp.parameters()):
        t.grad = None
    mlp(x).pow(2).sum().backward()
    for got, t in zip(tiled, (x, *mlp.parameters())):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-7)


def test_a_parameter_the_tiled_function_was_not_given_is_refused():
    hidden = nn.Linear(4, 4)  # read through a closure: neither in compute_params nor passed
    x = torch.randn(1, 6, 4, requires_grad=True)
    out = sequence_tiled_compute(lambda x: hidden(x), 6, 2, {"x": x}, {}, "x", [], 1, "sum")
    with pytest.raises(ValueError, match=r"trainable tensor of shape \[4, 4\].*add it to compute_params"):
        out.backward()
    with pytest.raises(ValueError, match="add it to compute_params"):
        TiledFusedLogitsLoss.apply(lambda owner, a, b: hidden(a).sum(), None, x, x.detach(), None, 2, [], "sum")


@pytest.mark.parametrize(("call", "message"), [
    (lambda x: sequence_tiled_compute(lambda x: x, 6, 2, {"x": x}, {}, "y"), "grad_requiring_tensor_key='y'"),
    (lambda x: sequence_tiled_compute(lambda x: x, 8, 2, {"x": x}, {}, "x"), r"\[1, 6, 4\].*seqlen=8"),
    (lambda x: sequence_tiled_compute(lambda x: x, 6, 2, {"x": x}, {}, "x", output_reduction="avg"), "'avg'"),
    (lambda x: TiledFusedLogitsLoss.apply(lambda *a: a[1].sum(), None, x, x[:, :3], None, 2, [], "sum"),
     r"x \[1, 6, 4\] and y \[1, 3, 4\]"),
    (lambda x: TiledFusedLogitsLoss.apply(lambda *a: a[1].sum(), None, x, x, None, 2, [], "none"), "'none'"),
])
def test_bad_tiled_compute_arguments_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 6, 4))


STEPS = 3
PLACES = {"engine_forward": "fused", "after_base_model": "sequence_tiled"}  # where the loss runs: how it tiles


class _TiledLossModel(nn.Module):
    """A causal LM whose forward returns the tiled loss: the tiled function runs inside the engine's forward."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return _tiled_loss(self.lm, input_ids, "fused")


def _rank_batch(step: int, rank: int) -> torch.Tensor:
    return global_batch(step)[rank * 4 : rank * 4 + 4]


def _reference(how: str) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for step in range(STEPS):
        # Each rank's loss is the mean over its tokens; the engine averages the ranks' gradients.
        loss = sum(_tiled_loss(model, _rank_batch(step, r), how) for r in (0, 1)) / 2
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_runs() -> dict[tuple, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    import zerotrain
    from zerotrain.zero import GatheredParameters

    out = {}
    for stage in (2, 3):
        for place in PLACES:
            lm = make_model()
            model = _TiledLossModel(lm) if place == "engine_forward" else lm
            engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(lm),
                                              config=zero_config(stage, 2, 1))
            for step in range(STEPS):
                ids = _rank_batch(step, dist.get_rank())
                if place == "engine_forward":
                    loss = engine(ids)
                else:  # ArcticTraining's order: the base model, then the tiled loss on its hidden states
                    loss = _tiled_loss(engine.module, ids, "sequence_tiled")
                engine.backward(loss)
                engine.step()
            with GatheredParameters(list(lm.parameters())):
                out[(stage, place)] = {n: p.detach().clone() for n, p in lm.named_parameters()}
    return out


@pytest.mark.slow
def test_zero2_and_zero3_training_with_the_tiled_loss_matches_one_process():
    # One process with the same tiled loss: the fused loss scales its gradients by the incoming one after
    # computing them (DeepSpeed's order), a rounding per element that AdamW amplifies on small gradients.
    runs, _ = run_on_ranks(2, _zero_runs)
    references = {place: _reference(how) for place, how in PLACES.items()}
    for (stage, place), weights in runs.items():
        for name, ref in references[place].items():
            assert (weights[name] - ref).norm() <= 1e-5 * ref.norm() + 1e-7, (stage, place, name)
