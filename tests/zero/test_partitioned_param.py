"""ZeRO-3 parameters say they are partitioned, and otherwise behave as nn.Parameter.

Most checks run in this process: on a one-rank bucket whose all-gather is a copy, and on
the buckets of every rank of a small world, whose all-gather concatenates their kept shards;
one runs a real two-rank stage-3 engine.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from conftest import run_on_ranks
from in_process_gather import gather_over
from llama_workload import train_reference, train_zerotrain, zero_config
from zerotrain.zero.partitioned_param import ZeroParamStatus


@pytest.fixture
def partitioned_linear(monkeypatch):
    """An nn.Linear whose parameters are a freed stage-3 bucket of one rank, and the bucket."""
    from zerotrain.zero.flat_param import FlatParam

    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    reference = copy.deepcopy(linear)  # a plain twin, before partitioning
    fp = FlatParam([linear.weight, linear.bias], ["weight", "bias"], 0, world_size=1, rank=0, sharded=True)
    fp.make_master(torch.float32)  # as build_flat_params does: fp32 on the device, the shard is its own master
    fp.keep_only_shard()
    gather_over(monkeypatch, [fp])  # a world of one
    return linear, fp, reference


def test_a_freed_parameter_says_it_is_partitioned_with_its_full_shape(partitioned_linear):
    from zerotrain.zero.partitioned_param import PartitionedParameter

    linear, _, _ = partitioned_linear
    w = linear.weight
    assert isinstance(w, PartitionedParameter) and isinstance(w, nn.Parameter)
    assert w.numel() == 0 and tuple(w.ds_shape) == (3, 4) and w.ds_numel == 12
    assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE
    text = repr(w)
    assert text.startswith("PartitionedParameter(ds_shape=(3, 4), dtype=torch.float32, requires_grad=True")
    assert "sharded across 1 rank;" in text and "zerotrain.zero.GatheredParameters([param])" in text
    assert str(w) == text and f"{w}" == text


def test_a_gathered_parameter_prints_as_a_plain_parameter(partitioned_linear):
    linear, fp, reference = partitioned_linear
    fp.gather()
    w = linear.weight
    assert w.ds_status is ZeroParamStatus.AVAILABLE and w.shape == (3, 4)
    assert repr(w) == repr(reference.weight)  # "Parameter containing:\ntensor([[...]], requires_grad=True)"
    fp.free()
    assert w.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_autograd_and_torch_optimizers_treat_it_as_a_parameter(partitioned_linear):
    linear, fp, reference = partitioned_linear
    fp.gather()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (linear, reference)]
    x = torch.randn(5, 4)
    for m, opt in zip((linear, reference), opts):
        m(x).square().sum().backward()
        opt.step()
    torch.testing.assert_close(linear.weight.detach(), reference.weight.detach(), rtol=0, atol=0)
    fp.free()  # the step changed only the gathered buffer: freeing it drops the change
    fp.gather()
    assert not torch.equal(linear.bias.detach(), reference.bias.detach())


def test_a_step_inside_gathered_parameters_with_a_modifier_rank_persists(partitioned_linear):
    from zerotrain.zero import GatheredParameters

    linear, fp, reference = partitioned_linear
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (linear, reference)]
    x = torch.randn(5, 4)
    with GatheredParameters(list(linear.parameters()), modifier_rank=0):
        linear(x).square().sum().backward()
        opts[0].step()
    reference(x).square().sum().backward()
    opts[1].step()
    assert linear.weight.numel() == 0  # freed again on exit; the kept shard holds the step
    stepped = torch.cat([reference.weight.detach().flatten(), reference.bias.detach()])
    torch.testing.assert_close(fp.local_shard, stepped)
    fp.gather()
    torch.testing.assert_close(linear.weight.detach(), reference.weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(linear.bias.detach(), reference.bias.detach(), rtol=0, atol=0)


# 15 known values, none zero (padding must read as zeros): a 3x4 weight and a bias of 3.
KNOWN_WEIGHT = torch.arange(1.0, 13.0).view(3, 4)
KNOWN_BIAS = -torch.arange(1.0, 4.0)


def _partition_on_every_rank(world: int, monkeypatch) -> list[tuple[nn.Linear, object]]:
    """(linear, bucket) of each rank of `world`, built from the known values and freed to the kept
    shard; their all-gather concatenates the ranks' kept shards, as the collective does."""
    from zerotrain.zero.flat_param import FlatParam

    ranks = []
    for rank in range(world):
        linear = nn.Linear(4, 3)
        with torch.no_grad():
            linear.weight.copy_(KNOWN_WEIGHT)
            linear.bias.copy_(KNOWN_BIAS)
        fp = FlatParam([linear.weight, linear.bias], ["weight", "bias"], 0, world_size=world, rank=rank, sharded=True)
        fp.keep_only_shard()
        ranks.append((linear, fp))
    gather_over(monkeypatch, [fp for _, fp in ranks])
    return ranks


@pytest.mark.parametrize("world", [2, 4, 7])  # 7: 15 elements in shards of 3, two ranks hold only padding
def test_each_rank_keeps_its_slice_and_a_gather_rebuilds_the_whole(world, monkeypatch):
    ranks = _partition_on_every_rank(world, monkeypatch)
    size = math.ceil(15 / world)
    padded = torch.cat([KNOWN_WEIGHT.flatten(), KNOWN_BIAS, torch.zeros(size * world - 15)])
    for rank, (linear, fp) in enumerate(ranks):
        assert (fp.shard_size, fp.shard_start, fp.padding) == (size, rank * size, size * world - 15)
        torch.testing.assert_close(fp.local_shard, padded[rank * size : (rank + 1) * size], rtol=0, atol=0)
        assert linear.weight.numel() == 0 and linear.bias.numel() == 0  # the whole buffer is freed
    for linear, fp in ranks:
        fp.gather()
        torch.testing.assert_close(linear.weight.detach(), KNOWN_WEIGHT, rtol=0, atol=0)
        torch.testing.assert_close(linear.bias.detach(), KNOWN_BIAS, rtol=0, atol=0)
        fp.free()


def test_what_each_rank_writes_to_its_shard_is_what_every_rank_gathers(monkeypatch):
    ranks = _partition_on_every_rank(4, monkeypatch)
    new = torch.arange(100.0, 116.0)  # 4 shards of 4; the last element is padding
    for rank, (_, fp) in enumerate(ranks):
        fp.set_shard(new[rank * 4 : (rank + 1) * 4])  # how the optimizer step and a checkpoint load write
    for linear, fp in ranks:
        fp.gather()
        torch.testing.assert_close(linear.weight.detach(), new[:12].view(3, 4), rtol=0, atol=0)
        torch.testing.assert_close(linear.bias.detach(), new[12:15], rtol=0, atol=0)
        fp.free()


def test_state_dict_holds_plain_tensors(partitioned_linear):
    linear, fp, reference = partitioned_linear
    assert [tuple(t.shape) for t in linear.state_dict().values()] == [(0,), (0,)]  # partitioned: gather first
    fp.gather()
    state = linear.state_dict()
    assert all(type(t) is torch.Tensor for t in state.values())
    torch.testing.assert_close(state, reference.state_dict(), rtol=0, atol=0)


def test_deepcopy_copies_values_while_gathered_and_says_it_has_none_otherwise(partitioned_linear):
    from zerotrain.zero.partitioned_param import PartitionedParameter

    linear, fp, reference = partitioned_linear
    empty = copy.deepcopy(linear)
    assert type(empty.weight) is PartitionedParameter and empty.weight.numel() == 0
    assert tuple(empty.weight.ds_shape) == (3, 4) and empty.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert "it holds no values" in repr(empty.weight)
    fp.gather()
    whole = copy.deepcopy(linear)
    assert type(whole.weight) is nn.Parameter  # an ordinary, independent parameter
    torch.testing.assert_close(whole.weight, reference.weight, rtol=0, atol=0)
    assert whole.weight.data_ptr() != linear.weight.data_ptr()
    tied = nn.ModuleList([linear, linear])
    twin = copy.deepcopy(tied)
    assert twin[0].weight is twin[1].weight  # deepcopy's memo keeps tied weights tied


def test_other_parameter_subclasses_keep_their_class():
    from zerotrain.zero.partitioned_param import mark_partitioned

    class Custom(nn.Parameter):
        pass

    custom = Custom(torch.zeros(2))
    mark_partitioned(custom)
    assert type(custom) is Custom


def _stage3_engine_parameters() -> dict:
    from zerotrain.zero import GatheredParameters
    from zerotrain.zero.partitioned_param import PartitionedParameter

    run = train_zerotrain(zero_config(3, 2, 1), steps=3)
    module = run["engine"].module
    head = module.lm_head.weight
    params = list(module.parameters())
    freed = repr(head)
    with GatheredParameters([head]):
        gathered = repr(head)
        status_inside = head.ds_status
    return {
        "losses": run["losses"],
        "all_partitioned": all(isinstance(p, PartitionedParameter) and isinstance(p, nn.Parameter) for p in params),
        "statuses": {p.ds_status for p in params},
        "freed": freed,
        "gathered": gathered,
        "status_inside": status_inside,
        "ds_shape": tuple(head.ds_shape),
    }


@pytest.mark.slow
def test_stage3_engine_parameters_are_partitioned_and_training_still_matches():
    ref_losses, _ = train_reference(steps=3)
    per_rank = run_on_ranks(2, _stage3_engine_parameters)
    for r in per_rank:
        assert r["all_partitioned"] and r["statuses"] == {ZeroParamStatus.NOT_AVAILABLE}
        assert r["ds_shape"] == (64, 32)
        assert r["freed"].startswith("PartitionedParameter(ds_shape=(64, 32), dtype=torch.float32")
        assert "sharded across 2 ranks" in r["freed"]
        assert r["gathered"].startswith("Parameter containing:\ntensor([[") and r["status_inside"] is ZeroParamStatus.AVAILABLE
    losses = [sum(step) / 2 for step in zip(*(r["losses"] for r in per_rank))]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_a_deepspeed_style_maybe_zero_3_gathers_the_whole_values(partitioned_linear, standin_deepspeed):
    """The idiom of LLaVA-style training scripts and TRL: a parameter with `ds_id` whose status
    is NOT_AVAILABLE is read inside GatheredParameters. Without `ds_id` they would save it empty."""
    from deepspeed import zero
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as DeepSpeedStatus

    linear, fp, reference = partitioned_linear

    def maybe_zero_3(param):
        if hasattr(param, "ds_id"):
            assert param.ds_status == DeepSpeedStatus.NOT_AVAILABLE
            with zero.GatheredParameters([param]):
                return param.data.detach().cpu().clone()
        return param.detach().cpu().clone()

    assert torch.equal(maybe_zero_3(linear.weight), reference.weight.detach())
    assert torch.equal(maybe_zero_3(linear.bias), reference.bias.detach())
    assert isinstance(linear.weight.ds_id, int) and linear.weight.ds_id != linear.bias.ds_id
    fp.gather(async_op=True)  # a prefetch in flight
    assert linear.weight.ds_status is ZeroParamStatus.INFLIGHT
    fp.gather()
    assert linear.weight.ds_status is ZeroParamStatus.AVAILABLE
