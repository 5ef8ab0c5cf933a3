"""ParamGatherer: ZeRO-3's forward and backward hooks on units, with prefetch and reuse.

Before a unit's forward its FlatParams are all-gathered; after it they are
freed. A hook on the unit's outputs gathers them again when backward reaches
the unit; the GradReducer frees them once the unit's gradients are launched
for reduce-scatter. The root unit (embeddings, final norm, head) wraps the whole
forward, so it stays gathered from the start of forward to the end of backward.
Per optimizer step a rank thus moves Ψ (forward gathers) + Ψ (backward gathers)
+ Ψ (reduce-scatter) = 3Ψ elements, less the root's backward re-gather, and
less what reuse (below) keeps.

The first forward records the order units run in; backward is taken to visit
them in reverse. From then on, with DeepSpeed's meaning of the stage-3 knobs
(all in elements, counted as the padded sizes of a unit's sharded FlatParams):

- Prefetch (`stage3_prefetch_bucket_size`): when a unit starts (forward) or its
  gradient arrives (backward), the gathers of the units that come next are
  launched asynchronously, so communication overlaps the current unit's compute.
- Live limit (`stage3_max_live_parameters`): prefetch stops rather than take the
  gathered elements above the limit; the unit needed now is always gathered,
  evicting units kept for reuse (kept longest first) to make room.
- Reuse (`stage3_max_reuse_distance`): when a unit's forward ends and the trace
  says it runs again (called twice, or its own backward) with fewer than this
  many elements of other units gathered in between, it stays gathered, so
  its next use needs no gather, as long as the live limit holds at that moment.
  With DeepSpeed's default of 1e9, a model under a billion elements per rank
  gathers its layers once per step. 0 frees every unit after its forward.

Whatever was kept is freed at the end of backward (the GradReducer frees every
bucket it reduces) or at the end of a forward without gradients, so between
steps a rank holds only shards.

External parameters (`register_external_parameter`): a parameter registered on a
module is gathered with that module's unit, for its forward and its backward, and
freed after its forward (unless its own unit is kept). One registered on the root
or on a module outside every layer stays gathered, like the root's own, from the
start of forward until its gradient is reduced.

Host work per unit and pass does not grow with the unit's parameters or outputs, nor
with the model's depth: one backward hook per unit and forward (registered on each
output that needs a gradient, it runs once per backward, whichever output's gradient
comes first), a live-element tally that FlatParam keeps as it gathers and frees
(`LiveElements`), each unit's needed buckets (its own and its external ones) listed once
per registration change, and a prefetch that resumes where its last scan found a unit
not yet gathered instead of rescanning units already whole. The hooks run eagerly under
torch.compile (`eager_hooks.py`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zerotrain.zero.eager_hooks import eager_hook
from zerotrain.zero.external_params import external_parameters, registration_generation
from zerotrain.zero.flat_param import FlatParam, LiveElements

# DeepSpeed's defaults for stage3_max_live_parameters and stage3_max_reuse_distance.
DEFAULT_MAX_LIVE_NUMEL = 1_000_000_000
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
_NO_FRONTIER = (0, 0, 0)  # no scan to resume


class ParamGatherer:
    """Installs the gather/free hooks of every unit of a stage-3 model."""

    def __init__(
        self,
        flat_params: list[FlatParam],
        root: nn.Module,
        prefetch_numel: int = 0,
        max_live_numel: int = DEFAULT_MAX_LIVE_NUMEL,
        max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE,
    ) -> None:
        self.root = root
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.by_unit: dict[nn.Module, list[FlatParam]] = defaultdict(list)
        for fp in flat_params:
            self.by_unit[fp.unit].append(fp)
        self._sharded = [fp for fp in flat_params if not fp.persistent]
        self.live = LiveElements()  # kept by the buckets themselves: gathers and frees from anywhere count
        for fp in self._sharded:
            fp.live_tally = self.live
        self.live.numel = sum(fp.padded_numel for fp in self._sharded if _is_live(fp))
        self.order: list[nn.Module] = []  # layer units in forward order, recorded once
        self._recorded = False
        self._cursor = -1  # position of the running unit in `order`
        # Per forward position: elements gathered before the unit's next use, None if not used again.
        self._distance_training: list[int | None] = []  # trace = forward, then backward in reverse
        self._distance_inference: list[int | None] = []  # trace = forward only
        self._kept: list[nn.Module] = []  # units left gathered for reuse, oldest first
        self._external: dict[nn.Module, list[FlatParam]] = {}  # unit -> other units' buckets it reads
        self._pinned: set[int] = set()  # ids of buckets the root reads: gathered through backward
        self._external_generation = -1
        self._needed: dict[nn.Module, list[FlatParam]] = {}  # unit -> its buckets and the external ones it reads
        # Prefetch skips the positions its last scan found whole or in flight: (direction, first, next).
        self._frontier: tuple[int, int, int] = _NO_FRONTIER
        self._repeated: set[nn.Module] = set()  # units that appear twice in the order
        self._handles = []
        self._root_depth = 0  # > 0 inside the root's forward
        self.install_hooks()

    def install_hooks(self) -> list:
        """Hooks every unit's forward (again, after `remove_hooks`); returns the handles."""
        self.remove_hooks()
        before, after = eager_hook(self._before_forward), eager_hook(self._after_forward)
        self._before_backward_eager = eager_hook(self._before_backward)
        # The root is hooked even without parameters of its own: its forward delimits each step.
        for unit in {**dict.fromkeys(self.by_unit), self.root: None}:
            self._handles.append(unit.register_forward_pre_hook(before))
            self._handles.append(unit.register_forward_hook(after))
        # The root unit's parameters are also gathered by the modules that own them, for calls
        # that do not go through the root's forward (DeepSpeed-Chat's `reward_model.forward_value`).
        root_params = {id(p) for fp in self.by_unit.get(self.root, []) for p in fp.params}
        for module in self.root.modules():
            if module is not self.root and any(id(p) in root_params for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(eager_hook(self._before_root_part)))
                self._handles.append(module.register_forward_hook(eager_hook(self._after_root_part)))
        return self._handles

    @property
    def hooks(self) -> list:
        """The handles of the hooks installed now."""
        return list(self._handles)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def forget_order(self) -> None:
        """Records the units' order again at the next forward (the model may run differently now)."""
        self.order, self._recorded, self._cursor, self._kept = [], False, -1, []
        self._frontier = _NO_FRONTIER

    # --- hooks -----------------------------------------------------------------------------

    def _before_root_part(self, module: nn.Module, args) -> None:
        if not self._root_depth:
            self._acquire(self.root)

    def _after_root_part(self, module: nn.Module, args, output) -> None:
        if not self._root_depth and not torch.is_grad_enabled():
            self._free_unit(self.root)  # no backward will follow; with one, the reducer frees it

    def _before_forward(self, unit: nn.Module, args) -> None:
        if unit is self.root:
            self._root_depth = 1  # set, not counted: a forward that raised never ran its post-hook
        if self._recorded and _in_backward():
            # Activation checkpointing recomputes the unit inside backward (older transformers and
            # `checkpoint(module, ...)` run module hooks again): gather it, and move nothing else.
            # A forward-order prefetch here would re-gather units already reduced and freed.
            self._acquire(unit)
            return
        if unit is self.root:
            self._cursor, self._frontier = -1, _NO_FRONTIER
            self._kept = [u for u in self._kept if any(_is_live(fp) for fp in self.by_unit[u])]
        elif not self._recorded and self._root_depth:
            self.order.append(unit)  # the order is that of the root's forward
        self._acquire(unit)
        if unit is not self.root and self._recorded:
            cursor = self._position(unit, start=self._cursor + 1)
            if cursor <= self._cursor:
                self._frontier = _NO_FRONTIER  # the model ran differently: rescan
            self._cursor = cursor
            self._prefetch(range(self._cursor + 1, len(self.order)))

    def _after_forward(self, unit: nn.Module, args, output) -> None:
        if unit is self.root:
            self._root_depth = 0
        if self._recorded and _in_backward():
            return  # a recompute: the unit's backward runs next; the GradReducer frees it after
        if unit is self.root:
            if not self._recorded:
                self._finish_recording()
            if not torch.is_grad_enabled():
                self.free_all()  # no backward will follow (evaluation, generation)
            return  # else the head and embeddings are needed by backward; freed after their reduction
        if self._recorded and self._worth_keeping(self._cursor):
            self._kept.append(unit)
        else:
            self._free_unit(unit)
        self._free_externals(unit)
        if torch.is_grad_enabled():
            position = len(self.order) - 1 if not self._recorded else self._cursor
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                hook = self._backward_hook(unit, position)
                for t in outputs:
                    t.register_hook(hook)

    def _backward_hook(self, unit: nn.Module, position: int):
        """The one hook of `unit`'s outputs of this forward: gathers the unit when the first of their
        gradients arrives in a backward (as `register_multi_grad_hook(mode="any")`, without its lock)."""
        ran_in = [None]  # the backward (graph task) it last ran in: a retained graph may run again

        def on_grad(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if ran_in[0] != task:
                ran_in[0] = task
                self._before_backward_eager(unit, position)

        return on_grad

    def _before_backward(self, unit: nn.Module, position: int) -> None:
        self._acquire(unit)
        self._prefetch(range(position - 1, -1, -1))

    # --- decisions -------------------------------------------------------------------------

    def _acquire(self, unit: nn.Module) -> None:
        """Gathers a unit needed now (and the external parameters it reads), first evicting
        kept units if it would break the live limit."""
        if unit in self._kept:
            self._kept.remove(unit)  # in use: not evictable until its forward ends again
        needed = self._needed_by(unit)
        if self._kept:
            missing = sum(fp.padded_numel for fp in needed if not fp.persistent and not _is_live(fp))
            while self._kept and self.live.numel + missing > self.max_live_numel:
                # The oldest kept unit is the one reused last (backward runs in reverse).
                self._free_unit(self._kept.pop(0))
                self._frontier = _NO_FRONTIER  # it may be one a prefetch scan counted as whole
        for fp in needed:
            if not fp.gathered:
                fp.gather()

    def _free_unit(self, unit: nn.Module) -> None:
        """Frees a layer unit's buckets, except those the root reads (needed until backward)."""
        _free([fp for fp in self.by_unit[unit] if id(fp) not in self._pinned])
        if unit in self._repeated:
            self._frontier = _NO_FRONTIER  # it runs again later: prefetch must see it freed

    def _free_externals(self, unit: nn.Module) -> None:
        """After `unit`'s forward: frees the other units' buckets it read, unless still in use."""
        for fp in self._externals_of(unit):
            if fp.unit is not self.root and fp.unit not in self._kept and id(fp) not in self._pinned:
                if fp.gathered or fp._pending_gather is not None:
                    self._frontier = _NO_FRONTIER  # another unit's bucket: a prefetch may have counted it
                fp.free()

    def _externals_of(self, unit: nn.Module) -> list[FlatParam]:
        if self._external_generation != registration_generation():
            self._map_external_parameters()
        return self._external.get(unit, [])

    def _needed_by(self, unit: nn.Module) -> list[FlatParam]:
        """The buckets `unit`'s forward and backward read: its own, then the external ones."""
        if self._external_generation != registration_generation():
            self._map_external_parameters()
        needed = self._needed.get(unit)
        if needed is None:
            needed = self._needed[unit] = self.by_unit.get(unit, []) + self._external.get(unit, [])
        return needed

    def _map_external_parameters(self) -> None:
        """Which unit runs each module with registered external parameters, and their buckets."""
        owner: dict[nn.Module, nn.Module] = {}
        for unit in self.by_unit:
            if unit is not self.root:
                for module in unit.modules():
                    owner.setdefault(module, unit)
        external: dict[nn.Module, list[FlatParam]] = defaultdict(list)
        for module in self.root.modules():
            unit = owner.get(module, self.root)
            for p in external_parameters(module):
                fp = getattr(p, "_zerotrain_flat_param", None)  # only partitioned buckets have one
                if fp is not None and fp.unit is not unit and all(fp is not seen for seen in external[unit]):
                    external[unit].append(fp)
        self._external = dict(external)
        self._pinned = {id(fp) for fp in self._external.get(self.root, [])}
        self._needed = {}
        self._external_generation = registration_generation()

    def _worth_keeping(self, position: int) -> bool:
        """Whether the unit that just ran at `position` is reused soon enough to stay gathered."""
        distances = self._distance_training if torch.is_grad_enabled() else self._distance_inference
        distance = distances[position] if 0 <= position < len(distances) else None
        return distance is not None and distance < self.max_reuse_distance and self.live.numel <= self.max_live_numel

    def _prefetch(self, positions: range) -> None:
        """Launches the gathers of the units at `positions` (in that order) within the budget."""
        budget = min(self.prefetch_numel, self.max_live_numel - self.live.numel)
        d, first, start = positions.step, positions.start, positions.start
        direction, scanned_from, frontier = self._frontier
        if direction == d and (start - scanned_from) * d >= 0 and (frontier - start) * d > 0:
            first, start = scanned_from, frontier  # [scanned_from, frontier) was whole or in flight
        for i in range(start, positions.stop, d):
            for fp in self.by_unit[self.order[i]]:
                if fp.persistent or _is_live(fp):
                    continue  # already whole, kept, or on its way: costs nothing more
                if budget < fp.padded_numel:
                    self._frontier = (d, first, i)
                    return
                budget -= fp.padded_numel
                fp.gather(async_op=True)
        self._frontier = (d, first, positions.stop)

    def _live_numel(self) -> int:
        """Elements of sharded buckets now whole on this rank, or being gathered."""
        return self.live.numel

    # --- the recorded order ----------------------------------------------------------------

    def _finish_recording(self) -> None:
        self._recorded = True
        self._repeated = {unit for i, unit in enumerate(self.order) if unit in self.order[:i]}
        self._distance_inference = self._reuse_distances(self.order)
        self._distance_training = self._reuse_distances(self.order + self.order[::-1])

    def _reuse_distances(self, trace: list[nn.Module]) -> list[int | None]:
        """For each forward position, the elements of the units run between it and its unit's
        next appearance in `trace` (a unit counted at every appearance, as DeepSpeed does)."""
        size = {unit: sum(fp.padded_numel for fp in fps if not fp.persistent) for unit, fps in self.by_unit.items()}
        out: list[int | None] = []
        for i, unit in enumerate(self.order):
            distance, found = 0, None
            for later in trace[i + 1 :]:
                if later is unit:
                    found = distance
                    break
                distance += size[later]
            out.append(found)
        return out

    def _position(self, unit: nn.Module, start: int) -> int:
        """Where `unit` runs in the recorded order (a unit called twice appears twice)."""
        for i in range(max(start, 0), len(self.order)):
            if self.order[i] is unit:
                return i
        return next((i for i, u in enumerate(self.order) if u is unit), len(self.order) - 1)

    # --- everything at once ----------------------------------------------------------------

    def gather_all(self) -> None:
        """Makes every parameter whole (for export); `free_all` undoes it."""
        for fps in self.by_unit.values():
            _gather(fps)

    def free_all(self) -> None:
        """Frees every partitioned unit, including those kept for reuse."""
        self._kept.clear()
        for fps in self.by_unit.values():
            _free(fps)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (a checkpointed recompute)."""
    return torch._C._current_graph_task_id() != -1


def _is_live(fp: FlatParam) -> bool:
    """Whole, or with a prefetch in flight (its buffer is allocated either way)."""
    return fp.gathered or fp._pending_gather is not None


def _gather(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.gather()


def _free(fps: list[FlatParam]) -> None:
    for fp in fps:
        fp.free()
