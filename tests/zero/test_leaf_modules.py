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


def _engine_with_leaf_config(model: nn.Module, leaf_module: dict | None, stage: int = 3):
    import zerotrain

    zero = {"stage": stage} if leaf_module is None else {"stage": stage, "leaf_module": leaf_module}
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero}
    return zerotrain.initialize(model=model, config=config)[0]


def test_the_leaf_module_config_section_flags_modules_at_engine_build():
    """DeepSpeed >= 0.17's zero_optimization.leaf_module: classes, names and name suffixes, as its engine
    applies them when built; a name is one of named_modules() (a single string is a list of one)."""
    from zerotrain.zero.units import find_layer_units

    by_name = OneLayerMoE()
    engine = _engine_with_leaf_config(by_name, {"names": "moe"})
    assert by_name.moe._z3_leaf is True and find_layer_units(by_name) == []  # experts not split into units
    assert {id(fp.unit) for fp in engine.flat_params} == {id(by_name)}  # all gathered with the root
    by_suffix = TwoLayerMoE()
    _engine_with_leaf_config(by_suffix, {"name_suffixes": ["experts.1"], "classes": []})
    flagged = [n for n, m in by_suffix.named_modules() if getattr(m, "_z3_leaf", False)]
    assert flagged == ["layers.0.experts.1", "layers.1.experts.1"]  # every name that ends so
    by_class = TwoLayerMoE()
    _engine_with_leaf_config(by_class, {"classes": ["Experts"]})
    assert all(layer._z3_leaf for layer in by_class.layers)
    untouched = OneLayerMoE()  # no section: DeepSpeed's default classes (transformers' MoE blocks) only
    _engine_with_leaf_config(untouched, None)
    assert not any(getattr(m, "_z3_leaf", False) for m in untouched.modules())
    below_stage3 = OneLayerMoE()  # no units below ZeRO-3: the section changes nothing, checks nothing
    _engine_with_leaf_config(below_stage3, {"names": ["moe", "nothing"]}, stage=2)
    assert not any(getattr(m, "_z3_leaf", False) for m in below_stage3.modules())


@pytest.mark.parametrize("leaf_module, expected", [
    ({"names": ["moe", "layers.0.mlp"]}, "zero_optimization.leaf_module.names: ['layers.0.mlp'] match no module"),
    ({"name_suffixes": "gate"}, "zero_optimization.leaf_module.name_suffixes: ['gate'] match no module"),
    ({"classes": ["MixtralSparseMoeBlock"]}, "zero_optimization.leaf_module.classes: no module of "
                                             "['MixtralSparseMoeBlock'] in the model (OneLayerMoE)"),
], ids=["name", "suffix", "class"])
def test_a_leaf_module_entry_that_matches_nothing_is_a_config_error(leaf_module, expected):
    from zerotrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        _engine_with_leaf_config(OneLayerMoE(), leaf_module)
    assert expected in str(error.value)
    assert "model.named_modules()" in str(error.value) or "mixture-of-experts block" in str(error.value)


def test_deepspeeds_default_leaf_classes_name_transformers_moe_blocks_as_they_are_spelled():
    """Unset, leaf_module.classes is DeepSpeed's default: the three MoE blocks by module-qualified name,
    which must be where transformers keeps them for the default to flag anything."""
    import importlib

    from zerotrain.config.zero_schema import DEFAULT_LEAF_MODULE_CLASSES
    from zerotrain.zero.leaf_modules import _is_of_class

    for qualified in DEFAULT_LEAF_MODULE_CLASSES:
        module, name = qualified.rsplit(".", 1)
        block = getattr(importlib.import_module(module), name)
        assert _is_of_class(block.__new__(block), qualified), qualified
