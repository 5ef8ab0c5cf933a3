"""Units: the groups of parameters ZeRO-3 gathers, computes and frees together.

By default each block of the model's largest `nn.ModuleList` (a transformer's
layers) is a unit, and everything else (embeddings, final norm, head) forms the
root unit, owned by the model itself. A ModuleList inside a ZeRO-3 leaf module
(`leaf_modules.py`: an MoE block's experts) is never split into units.
"""

from __future__ import annotations

from torch import nn

from zerotrain.zero.leaf_modules import within_leaf_modules


def find_layer_units(model: nn.Module) -> list[nn.Module]:
    """The blocks of the largest ModuleList (by parameter count), in forward order; [] if none."""
    best: list[nn.Module] = []
    best_size = 0
    in_leaves = within_leaf_modules(model)  # a leaf (an MoE block) is gathered whole: never split
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and id(module) not in in_leaves:
            # ds_numel: a stage-3 parameter's full size while only its shard is held (it is empty then)
            size = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best


def assign_params_to_units(model: nn.Module, units: list[nn.Module]) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
    """Each trainable parameter's unit: the first layer unit holding it, else the root."""
    seen: set[int] = set()
    per_unit: list[list[nn.Parameter]] = []
    for unit in units:
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        per_unit.append(params)
    root = [p for p in model.parameters() if id(p) not in seen]
    return per_unit, root
