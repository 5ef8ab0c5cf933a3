"""ZeRO-3 leaf modules: DeepSpeed's `set_z3_leaf_modules` family on the stand-in, and what a leaf
means for zerotrain's units (no unit inside a leaf). Multi-rank training with leaves is in
test_moe_routing.py and tests/hf/test_moe_trainer.py."""

from __future__ import annotations

import pytest
from torch import nn


class Experts(nn.Module):
    """An MoE block's experts as a ModuleList (DeepSpeed's MoE, transformers 4's Mixtral)."""

    def __init__(self, count: int = 4, width: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, count, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(count))


class OneLayerMoE(nn.Module):
    """A one-layer MoE model: its largest ModuleList is the experts of its one block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.moe = Experts()


class TwoLayerMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Experts() for _ in range(2))


def test_set_get_and_unset_z3_leaf_modules_flag_modules_as_deepspeed_does(standin_deepspeed):
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

    model = TwoLayerMoE()
    assert get_z3_leaf_modules(model) == [] and not z3_leaf_module(model.layers[0])
    flagged = set_z3_leaf_modules(model, [Experts])
    assert flagged == list(model.layers) and get_z3_leaf_modules(model) == list(model.layers)
    assert all(m._z3_leaf is True for m in model.layers)  # DeepSpeed's attribute: code reading it directly agrees
    assert z3_leaf_module(model.layers[1]) and not z3_leaf_module(model.layers[1].router)
    # by class name, short or module-qualified, as Accelerate's ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES passes them
    assert unset_z3_leaf_modules(model, ["Experts"]) == list(model.layers)
    assert get_z3_leaf_modules(model) == [] and model.layers[0]._z3_leaf is False
    assert set_z3_leaf_modules(model, [f"{Experts.__module__}.Experts"]) == list(model.layers)


def test_set_z3_leaf_modules_says_when_no_module_matched(standin_deepspeed):
    from deepspeed.utils import set_z3_leaf_modules

    with pytest.raises(ValueError, match="no module of class \\['Conv2d'\\] found in the model"):
        set_z3_leaf_modules(TwoLayerMoE(), [nn.Conv2d])
    assert set_z3_leaf_modules(TwoLayerMoE(), [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="a list of classes or class names"):
        set_z3_leaf_modules(TwoLayerMoE(), Experts)  # a class, not a list of them


def test_no_unit_lies_inside_a_leaf_module(standin_deepspeed):
    from deepspeed.utils import set_z3_leaf_modules

    from zerotrain.zero.units import find_layer_units

    one_layer = OneLayerMoE()
    assert find_layer_units(one_layer) == list(one_layer.moe.experts)  # without a leaf: one unit per expert
    set_z3_leaf_modules(one_layer, [Experts])
    assert find_layer_units(one_layer) == []  # the block is gathered whole, with the root
    two_layers = TwoLayerMoE()
    set_z3_leaf_modules(two_layers, [Experts])
    assert find_layer_units(two_layers) == list(two_layers.layers)  # a leaf may be a unit itself
    whole_list = TwoLayerMoE()
    set_z3_leaf_modules(whole_list, [nn.ModuleList], raise_if_not_found=False)
    assert find_layer_units(whole_list) == []  # a ModuleList flagged as a leaf is not split either
