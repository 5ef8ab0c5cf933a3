"""Stage 3's host work per unit: one backward hook run per unit and pass, a live-element tally
that stays exact, gradient buffers whose count does not grow with depth, eager hooks.

One spawn (2 Gloo ranks) runs every case on a small model whose layers return two
tensors that need gradients (a transformer layer returning hidden states and an
auxiliary output), so a per-output hook would run twice per unit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_on_ranks

pytestmark = pytest.mark.slow  # starts processes

HIDDEN, GLOBAL_BATCH, STEPS, LR = 16, 8, 4, 1e-2


class TwoOutputBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(x)) + aux, self.b(x)


class TwoOutputNet(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, HIDDEN)
        self.layers = nn.ModuleList(TwoOutputBlock() for _ in range(layers))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        aux = torch.zeros_like(h)
        for layer in self.layers:
            h, aux = layer(h, aux)
        return (self.out(h + aux) - 1).pow(2).mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 4, generator=torch.Generator().manual_seed(step))


def _config(**zero_extra) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000, **zero_extra}
    return {"train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": zero, "steps_per_print": 1000}


def _train(engine, steps: int, each_step=None) -> list[float]:
    import torch.distributed as dist

    micro, rank, losses = GLOBAL_BATCH // dist.get_world_size(), dist.get_rank(), []
    for step in range(steps):
        loss = engine(_batch(step)[rank * micro : (rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if each_step is not None:
            each_step(step)
    return losses


def _hook_runs_and_parity() -> dict:
    """Runs of the backward hook per unit per step, and the losses and weights of training."""
    import zerotrain
    from zerotrain.zero import GatheredParameters
    from zerotrain.zero.param_gatherer import ParamGatherer

    runs: dict[int, int] = {}
    plain = ParamGatherer._before_backward

    def counted(self, unit, position):
        runs[id(unit)] = runs.get(id(unit), 0) + 1
        plain(self, unit, position)

    ParamGatherer._before_backward = counted  # before initialize: the engine hooks this one
    try:
        model = TwoOutputNet(layers=3)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=_config())
        per_step = []
        losses = _train(engine, STEPS, lambda step: (per_step.append([runs.pop(id(u), 0) for u in model.layers])))
    finally:
        ParamGatherer._before_backward = plain
    with GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"runs_per_step": per_step, "losses": losses, "weights": weights}


def _live_tally_checked() -> list[str]:
    """After every hook, and around a user's GatheredParameters: the tally against a recount."""
    import zerotrain
    from zerotrain.zero import GatheredParameters
    from zerotrain.zero.grad_reducer import GradReducer
    from zerotrain.zero.param_gatherer import ParamGatherer

    wrong: list[str] = []
    engines = []

    def check(where: str) -> None:
        gatherer = engines[0].param_gatherer
        recount = sum(fp.padded_numel for fp in gatherer._sharded if fp.gathered or fp._pending_gather is not None)
        if gatherer._live_numel() != recount:
            wrong.append(f"{where}: tally {gatherer._live_numel()} != {recount}")

    def checked(cls, name):
        plain = getattr(cls, name)

        def run(*args, **kwargs):
            plain(*args, **kwargs)
            if engines:
                check(f"{cls.__name__}.{name}")

        setattr(cls, name, run)
        return plain

    entry = {ParamGatherer: ["_before_forward", "_after_forward", "_before_backward"],
             GradReducer: ["_on_grad", "_on_backward_end"]}
    saved = {(cls, n): checked(cls, n) for cls, names in entry.items() for n in names}
    try:
        model = TwoOutputNet(layers=4)
        unit = sum(p.numel() for p in model.layers[0].parameters())
        # Reuse keeps units from forward for backward, and the live limit evicts some of them.
        cfg = _config(stage3_max_reuse_distance=10**9, stage3_max_live_parameters=3 * unit)
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engines.append(engine)

        def gather_between_steps(step: int) -> None:
            with GatheredParameters(list(model.layers[1].parameters())):
                check("inside GatheredParameters")
            check("after GatheredParameters")

        _train(engine, 3, gather_between_steps)
    finally:
        for (cls, name), plain in saved.items():
            setattr(cls, name, plain)
    return wrong


def _buffers_allocated_per_step(layers: int) -> list[int]:
    """torch.empty calls made by zerotrain/zero code in each step after the first."""
    import sys

    import zerotrain

    model = TwoOutputNet(layers)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=_config())
    counts, plain_empty = [0], torch.empty

    def counted_empty(*args, **kwargs):
        if "zerotrain/zero/" in sys._getframe(1).f_code.co_filename.replace("\\", "/"):
            counts[0] += 1
        return plain_empty(*args, **kwargs)

    per_step = []
    torch.empty = counted_empty
    try:
        _train(engine, 4, lambda step: (per_step.append(counts[0]), counts.__setitem__(0, 0)))
    finally:
        torch.empty = plain_empty
    return per_step[1:]


def _hooks_are_eager() -> list[str]:
    import zerotrain

    model = TwoOutputNet(layers=2)
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=_config())
    hooks = [h for m in model.modules() for h in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]]
    hooks += [h for p in model.parameters() for h in (p._post_accumulate_grad_hooks or {}).values()]
    hooks.append(getattr(engine.param_gatherer, "_before_backward_eager", None))  # what the output hooks call
    return [repr(h) for h in hooks if not getattr(h, "_torchdynamo_disable", False)] + ([] if hooks else ["no hooks"])


def _all_cases() -> dict:
    return {"parity": _hook_runs_and_parity(), "tally": _live_tally_checked(),
            "allocations": {n: _buffers_allocated_per_step(n) for n in (4, 8)}, "not_eager": _hooks_are_eager()}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_on_ranks(2, _all_cases)


def _reference() -> tuple[list[float], dict]:
    """Plain torch on one process, the whole global batch per step."""
    model = TwoOutputNet(layers=3)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_backward_hook_runs_once_per_unit_and_step_with_two_outputs(per_rank):
    for r in per_rank:
        assert r["parity"]["runs_per_step"] == [[1, 1, 1]] * STEPS


def test_two_output_units_train_as_plain_torch_on_the_global_batch(per_rank):
    ref_losses, ref_weights = _reference()
    # Each rank's loss is its half of the batch: their mean is the global loss. fp32 throughout;
    # the 2-rank gradient mean sums in another order than one process: 1e-5 relative.
    losses = [(a + b) / 2 for a, b in zip(per_rank[0]["parity"]["losses"], per_rank[1]["parity"]["losses"])]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(per_rank[0]["parity"]["weights"][name], ref, rtol=1e-5, atol=1e-6)


def test_live_tally_equals_a_recount_after_every_hook_and_user_gather(per_rank):
    for r in per_rank:
        assert r["tally"] == []


def test_gradient_buffers_allocated_per_step_do_not_grow_with_depth(per_rank):
    for r in per_rank:
        four, eight = r["allocations"][4], r["allocations"][8]
        assert four == eight, f"4 layers: {four} allocations per step, 8 layers: {eight}"


def test_every_hook_is_disabled_for_torch_compile(per_rank):
    assert per_rank[0]["not_eager"] == []
