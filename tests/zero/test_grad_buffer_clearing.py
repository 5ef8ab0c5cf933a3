"""Clearing a FlatParam's whole gradient writes nothing, yet the gradient reads as zeros.

`clear_grad_full` only marks every parameter's slot as unwritten: the next gradient
of a parameter overwrites its slot, later ones add to it, and `ensure_grad_full`
zeroes the slots nobody wrote before anyone reads the buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from zerotrain.zero.flat_param import FlatParam


def _flat_param() -> FlatParam:
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]  # 7 elements, padded to 8
    return FlatParam(params, ["a", "b"], 0, world_size=2, rank=0, sharded=True)


def test_a_new_buffer_reads_as_zeros_padding_included():
    fp = _flat_param()
    fp.add_grad(0, torch.full((3,), 2.0))
    assert torch.equal(fp.ensure_grad_full(), torch.tensor([2.0, 2.0, 2.0, 0, 0, 0, 0, 0]))


def test_after_a_clear_the_first_gradient_overwrites_and_later_ones_add():
    fp = _flat_param()
    fp.add_grad(0, torch.full((3,), 5.0))
    fp.add_grad(1, torch.full((2, 2), 7.0))
    fp.ensure_grad_full()
    fp.clear_grad_full()
    fp.add_grad(1, torch.full((2, 2), 1.0))
    fp.add_grad(1, torch.full((2, 2), 2.0))
    # parameter "a" got no gradient since the clear: its stale 5s read as zeros
    assert torch.equal(fp.ensure_grad_full(), torch.tensor([0, 0, 0, 3.0, 3.0, 3.0, 3.0, 0]))


def test_clearing_does_not_write_the_buffer():
    fp = _flat_param()
    fp.add_grad(0, torch.full((3,), 5.0))
    buffer = fp.ensure_grad_full()
    fp.clear_grad_full()
    assert torch.equal(buffer[:3], torch.full((3,), 5.0)), "no memset at clear time"
    assert fp.ensure_grad_full() is buffer and torch.equal(buffer, torch.zeros(8)), "zeroed when read"


def test_a_shard_viewing_the_whole_gradient_keeps_its_values_when_the_buffer_is_written_again():
    fp = _flat_param()  # rank 0 of 2: its shard is elements [0, 4)
    fp.add_grad(0, torch.full((3,), 5.0))
    fp.ensure_grad_full()
    fp.use_grad_full_slice_as_shard()  # as after an in-place reduction (Gloo)
    assert fp.grad_shard_is_view_of_full
    fp.clear_grad_full()
    fp.add_grad(1, torch.full((2, 2), 1.0))  # a second backward before the step
    assert not fp.grad_shard_is_view_of_full, "the shard got memory of its own before the write"
    assert torch.equal(fp.grad_shard, torch.tensor([5.0, 5.0, 5.0, 0.0]))
