"""ParamGatherer: ZeRO-3's forward and backward hooks on units, with prefetch.

Before a unit's forward its FlatParams are all-gathered; after it they are
freed. A hook on the unit's outputs gathers them again when backward reaches
the unit; the GradReducer frees them once the unit's gradients are launched
for reduce-scatter. The root unit (embeddings, final norm, head) wraps the whole
forward, so it stays gathered from the start of forward to the end of backward.
Per optimizer step a rank thus moves Ψ (forward gathers) + Ψ (backward gathers)
+ Ψ (reduce-scatter) = 3Ψ elements, less the root's backward re-gather.

Prefetch: the first forward records the order units run in. Afterwards, when a
unit starts (forward) or its gradient arrives (backward), the gathers of the
units that come next are launched asynchronously, up to `prefetch_numel`
elements, so communication overlaps the current unit's compute.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zerotrain.zero.flat_param import FlatParam


class ParamGatherer:
    """Installs the gather/free hooks of every unit of a stage-3 model."""

    def __init__(self, flat_params: list[FlatParam], root: nn.Module, prefetch_numel: int = 0) -> None:
        self.root = root
        self.prefetch_numel = prefetch_numel
        self.by_unit: dict[nn.Module, list[FlatParam]] = defaultdict(list)
        for fp in flat_params:
            self.by_unit[fp.unit].append(fp)
        self.order: list[nn.Module] = []  # layer units in forward order, recorded once
        self._recorded = False
        self._cursor = -1  # position of the running unit in `order`
        self._handles = []
        for unit in self.by_unit:
            self._handles.append(unit.register_forward_pre_hook(self._before_forward))
            self._handles.append(unit.register_forward_hook(self._after_forward))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    def _before_forward(self, unit: nn.Module, args) -> None:
        if unit is self.root:
            self._cursor = -1
        elif not self._recorded:
            self.order.append(unit)
        _gather(self.by_unit[unit])
        if unit is not self.root and self._recorded:
            self._cursor = self._position(unit, start=self._cursor + 1)
            self._prefetch(range(self._cursor + 1, len(self.order)))

    def _after_forward(self, unit: nn.Module, args, output) -> None:
        fps = self.by_unit[unit]
        if unit is self.root:
            self._recorded = True
            if not torch.is_grad_enabled():
                self.free_all()  # no backward will follow (evaluation, generation)
            return  # else the head and embeddings are needed by backward; freed after their reduction
        _free(fps)
        if torch.is_grad_enabled():
            position = len(self.order) - 1 if not self._recorded else self._cursor
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, unit=unit, position=position: self._before_backward(unit, position))

    def _before_backward(self, unit: nn.Module, position: int) -> None:
        _gather(self.by_unit[unit])
        self._prefetch(range(position - 1, -1, -1))

    def _prefetch(self, positions) -> None:
        budget = self.prefetch_numel
        for i in positions:
            for fp in self.by_unit[self.order[i]]:
                if budget < fp.padded_numel:
                    return
                budget -= fp.padded_numel
                fp.gather(async_op=True)

    def _position(self, unit: nn.Module, start: int) -> int:
        """Where `unit` runs in the recorded order (a unit called twice appears twice)."""
        for i in range(max(start, 0), len(self.order)):
            if self.order[i] is unit:
                return i
        return next((i for i, u in enumerate(self.order) if u is unit), len(self.order) - 1)

    def gather_all(self) -> None:
        """Makes every parameter whole (for export); `free_all` undoes it."""
        for fps in self.by_unit.values():
            _gather(fps)

    def free_all(self) -> None:
        """Frees every partitioned unit."""
        for fps in self.by_unit.values():
            _free(fps)


def _gather(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.gather()


def _free(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.free()
