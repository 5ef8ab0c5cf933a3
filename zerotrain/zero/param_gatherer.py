"""ParamGatherer: ZeRO-3's forward and backward hooks on units.

Before a unit's forward its FlatParams are all-gathered; after it they are
freed. A hook on the unit's outputs gathers them again when backward reaches
the unit; the GradReducer frees them once the unit's gradients are launched
for reduce-scatter. The root unit (embeddings, final norm, head) wraps the whole
forward, so it stays gathered from the start of forward to the end of backward.
Per optimizer step a rank thus moves Ψ (forward gathers) + Ψ (backward gathers)
+ Ψ (reduce-scatter) = 3Ψ elements.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zerotrain.zero.flat_param import FlatParam


class ParamGatherer:
    """Installs the gather/free hooks of every unit of a stage-3 model."""

    def __init__(self, flat_params: list[FlatParam], root: nn.Module) -> None:
        self.root = root
        self.by_unit: dict[nn.Module, list[FlatParam]] = defaultdict(list)
        for fp in flat_params:
            self.by_unit[fp.unit].append(fp)
        self._handles = []
        for unit, fps in self.by_unit.items():
            self._handles.append(unit.register_forward_pre_hook(lambda m, args, fps=fps: _gather(fps)))
            self._handles.append(unit.register_forward_hook(self._after_forward))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    def _after_forward(self, unit: nn.Module, args, output) -> None:
        fps = self.by_unit[unit]
        if not torch.is_grad_enabled():
            _free(fps)  # no backward will follow (evaluation, generation)
            return
        if unit is self.root:
            return  # the head and embeddings are needed again by backward; freed after their reduction
        _free(fps)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, fps=fps: _gather(fps))

    def gather_all(self) -> None:
        """Makes every parameter whole (for export); `free_all` undoes it."""
        for fps in self.by_unit.values():
            _gather(fps)

    def free_all(self) -> None:
        """Frees every unit (e.g. after a forward that had no backward)."""
        for fps in self.by_unit.values():
            _free(fps)


def _gather(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.gather()


def _free(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.free()
