"""FlatParam: a bucket of parameters laid end to end in one buffer, sharded over ranks.

Each `nn.Parameter` of the bucket becomes a view into `FlatParam.data`, so model
code never knows. Rank r owns the slice `[r*S, (r+1)*S)` of the (padded) buffer;
the fp32 master copy and the optimizer state exist only for that slice. Whether
the gradient is kept whole or only as the shard is the stage's decision (see
`zerotrain/zero/stage.py`); this class only holds the buffers. With NVMe offload
the shards themselves may be parked on disk (`nvme_params.py`, `nvme_offload.py`):
write them through `set_shard`, never by copying into `shard()` or `master`.

Per-use host work is kept to pointer swaps: each parameter's view of `data` is made
once per buffer (a freed buffer keeps its storage object, emptied in place, so the
views stay valid across free and gather), and a shared `LiveElements` tally follows
every gather and free so the stage-3 gatherer never sums over buckets.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn


class LiveElements:
    """Elements of the sharded buckets now whole on this rank or being gathered, kept up to date
    by `FlatParam.gather` and `free` for every bucket given this tally (stage 3's live limit)."""

    def __init__(self) -> None:
        self.numel = 0


class FlatParam:
    """Parameters of one bucket, flattened into one contiguous, shardable buffer."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group_index: int,
        world_size: int,
        rank: int,
        sharded: bool,
    ) -> None:
        self.params = params
        self.names = names
        self.group_index = group_index
        self.shapes = [p.shape for p in params]
        self._strides = [_contiguous_strides(shape) for shape in self.shapes]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.padded_numel, self.shard_size, self.shard_start = shard_layout(self.numel, world_size, rank, sharded)
        self.sharded = sharded
        device = params[0].device
        # Built in fp32 from the model's weights; `cast_to` moves it to the compute dtype.
        self.data = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.numels):
                self.data[off : off + n].copy_(p.detach().reshape(-1))
        self._param_views: list[torch.Tensor] = []  # each parameter's view of `data`, made once per buffer
        self._views_of: torch.Tensor | None = None  # the buffer `_param_views` view
        self._empty: torch.Tensor | None = None  # what freed parameters hold (one tensor for all)
        self._point_params_at_data()
        self.unit: nn.Module | None = None  # stage 3: the module whose forward needs these parameters
        self.persistent = False  # stage 3: small parameters kept whole, like stage 2's
        self.local_shard: torch.Tensor | None = None  # stage 3: the rank's slice while `data` is freed
        self.gathered = True
        self._pending_gather = None  # work handle of a prefetch in flight
        self.live_tally: LiveElements | None = None  # stage 3: counts this bucket while whole or in flight
        self.grad_pool = None  # stages 2-3: a GradBufferPool lending `grad_full` during backward
        self.swap = None  # stage 3 on NVMe: the NvmeParamOffload parking `local_shard` between uses
        self.master_swap = None  # NVMe optimizer offload: the NvmeOptimizerOffload parking `master`
        self.master: torch.Tensor | None = None  # fp32 shard the optimizer updates
        self.master_is_param = False  # fp32 training: the master is the parameter slice itself
        self.grad_full: torch.Tensor | None = None  # whole gradient, compute dtype
        # Per parameter: its slot of `grad_full` holds nothing of this accumulation yet (it reads as
        # zeros). Clearing the gradient only marks the slots, so no step pays for a memset of Ψ: the
        # next gradient overwrites its slot, and `ensure_grad_full` zeroes the slots nobody wrote.
        self._grad_unwritten = [True] * len(params)
        self._grad_slots: list[torch.Tensor] = []  # each parameter's slot of `grad_full`, shaped as it
        self._grad_slots_of: torch.Tensor | None = None  # the buffer `_grad_slots` view
        self.grad_shard: torch.Tensor | None = None  # this rank's reduced gradient slice

    @property
    def padding(self) -> int:
        """Elements added so the buffer divides evenly among ranks."""
        return self.padded_numel - self.numel

    def shard(self) -> torch.Tensor:
        """This rank's slice of the parameters: the kept shard (stage 3), else a view of the buffer."""
        if self.local_shard is not None:
            return self.local_shard
        return self.data[self.shard_start : self.shard_start + self.shard_size]

    # --- stage 3: parameters exist whole only between gather() and free() ----------------

    def keep_only_shard(self, device: torch.device | None = None, pin: bool = False) -> None:
        """Stage 3: keeps a private copy of this rank's slice (on `device` when parameters are
        offloaded) and frees the whole buffer."""
        from zerotrain.zero.partitioned_param import mark_partitioned

        self.local_shard = _on(self.shard().to(device or self.data.device, copy=True), pin)
        if self.master_is_param:
            self.master = self.local_shard
        for p, shape in zip(self.params, self.shapes):
            p.ds_shape = shape  # DeepSpeed's name for the full shape of a partitioned parameter
            p.ds_numel = shape.numel()
            p._zerotrain_flat_param = self  # lets GatheredParameters find a parameter's bucket
            mark_partitioned(p)  # prints as partitioned, not as an empty tensor
        self.free()

    def free(self, hand_over: bool = False) -> None:
        """Releases the whole buffer's memory. Parameters become empty tensors (their full shape
        stays in `param.ds_shape`): never views of freed memory, which would read garbage.

        Inside a step the storage is emptied in place, so the views autograd saved for backward
        see the values again once backward gathers the unit. With `hand_over` (the end of a user's
        `GatheredParameters`) the buffer gets a new storage instead, and the old one lives on for
        as long as the user holds tensors taken from it (`p.data.cpu()` is `p.data` on a CPU).
        """
        if self._pending_gather is not None:
            self.gather()  # a prefetch nobody used: let it land before releasing its memory
        if self.local_shard is not None and self.gathered:
            empty = self._empty
            if empty is None or empty.dtype != self.data.dtype:
                empty = self._empty = torch.empty(0, dtype=self.data.dtype, device=self.data.device)
            for p in self.params:
                p.data = empty
            if hand_over:
                self.data = empty  # the next gather allocates a new buffer
                self._param_views, self._views_of = [], None  # they would keep the user's storage alive
            else:
                self.data.untyped_storage().resize_(0)
            self.gathered = False
            if self.live_tally is not None:
                self.live_tally.numel -= self.padded_numel
        if self.swap is not None:
            self.swap.release(self)  # a read that a prefetch started and no gather used

    def gather(self, async_op: bool = False) -> None:
        """Rebuilds the whole buffer from every rank's shard (counted as parameter traffic).

        With `async_op` the all-gather is only launched (a prefetch); the next plain
        `gather()` waits for it. A shard parked on NVMe is read in first: a prefetch only
        launches the read, and the next `gather()` (prefetch or not) the all-gather.
        """
        if self.gathered:
            return
        if self._pending_gather is None:
            if self.swap is not None and self.swap.fetch(self, async_op):
                return
            from zerotrain.comm import distributed as zdist

            if self.data.numel() == self.padded_numel:
                self.data.untyped_storage().resize_(self.padded_numel * self.data.element_size())
            else:  # freed with hand_over: the old storage is the user's now
                self.data = torch.empty(self.padded_numel, dtype=self.data.dtype, device=self.data.device)
            shard = self.local_shard.to(self.data.device, non_blocking=True)  # offloaded shards come in first
            self._pending_gather = zdist.all_gather(self.data, shard, "param", async_op=True)
            if self.live_tally is not None:
                self.live_tally.numel += self.padded_numel
        if async_op:
            return
        self._pending_gather.wait()
        self._pending_gather = None
        self._point_params_at_data()
        self.gathered = True
        if self.swap is not None:
            self.swap.release(self)  # the whole buffer has it now: the shard may go back to disk

    def set_shard(self, values: torch.Tensor, with_master: bool = False) -> None:
        """Overwrites this rank's parameter slice with `values` (cast to the compute dtype), and
        its fp32 master too with `with_master`. The way to write a shard that may be on NVMe."""
        with torch.no_grad():
            if self.swap is not None:
                self.swap.overwrite(self, values)
            else:
                self.shard().copy_(values)
            if with_master and not self.master_is_param:
                with self.master_swap.resident([self]) if self.master_swap is not None else contextlib.nullcontext():
                    self.master.copy_(values)

    def copy_master_to_shard(self) -> None:
        """After the master changed (optimizer step, checkpoint load): the parameters follow it."""
        if not self.master_is_param:
            self.set_shard(self.master)

    def make_master(self, compute_dtype: torch.dtype, device: torch.device | None = None, pin: bool = False) -> None:
        """Creates the fp32 master shard, on `device` when the optimizer is offloaded.

        In fp32 training on the compute device it is the parameter slice itself (no copy).
        """
        shard = self.shard()
        device = device or shard.device
        self.master_is_param = compute_dtype == torch.float32 and device == shard.device
        if self.master_is_param:
            self.master = shard
        else:
            self.master = _on(shard.detach().to(device=device, dtype=torch.float32, copy=True), pin)

    def cast_to(self, dtype: torch.dtype) -> None:
        """Moves the parameter buffer to `dtype` and re-points every parameter at it."""
        if self.data.dtype != dtype:
            self.data = self.data.to(dtype)
            self._point_params_at_data()
        if self.local_shard is not None:
            self.local_shard = self.local_shard.to(dtype)

    def _point_params_at_data(self) -> None:
        if self._views_of is not self.data:  # a new buffer (cast, hand-over, zero.Init): new views
            self._param_views = [self._slot(self.data, i) for i in range(len(self.params))]
            self._views_of = self.data
        for p, view in zip(self.params, self._param_views):
            p.data = view

    def _slot(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s place in `buffer`, shaped as the parameter (one view op, not two)."""
        shape = self.shapes[index]
        return buffer.as_strided(shape, self._strides[index], self.offsets[index])

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Accumulates one parameter's gradient into the whole-gradient buffer."""
        buffer = self._grad_buffer()
        if self._grad_slots_of is not buffer:  # views made once per buffer (per step at most)
            self._grad_slots = [self._slot(buffer, i) for i in range(len(self.params))]
            self._grad_slots_of = buffer
        slot = self._grad_slots[index]
        if self._grad_unwritten[index]:
            slot.copy_(grad)  # the first gradient since the clear: nothing to add to
            self._grad_unwritten[index] = False
        else:
            slot.add_(grad)

    def ensure_grad_full(self) -> torch.Tensor:
        """The whole-gradient buffer, every slot valid: zeros where no parameter wrote a gradient."""
        grad = self._grad_buffer()
        for i, unwritten in enumerate(self._grad_unwritten):
            if unwritten:
                self._slot(grad, i).zero_()
                self._grad_unwritten[i] = False
        return grad

    def release_grad_full(self) -> None:
        """Drops the whole-gradient buffer (stages 2-3, once reduced): back to the pool it came from."""
        if self.grad_full is not None and self.grad_pool is not None:
            self.grad_pool.give_back(self.grad_full)
        self.grad_full = None
        self._grad_slots, self._grad_slots_of = [], None  # they would keep the buffer alive

    def clear_grad_full(self) -> None:
        """The whole gradient reads as zeros from now on, without writing Ψ zeros (see `add_grad`)."""
        self._grad_unwritten = [True] * len(self.params)

    def use_grad_full_slice_as_shard(self) -> None:
        """After an in-place reduction of `grad_full`: the rank's slice of it is the gradient shard.

        A view, not a copy. The next write to `grad_full` (a backward before the step uses the
        shard) first gives the shard memory of its own.
        """
        self.grad_shard = self.grad_full[self.shard_start : self.shard_start + self.shard_size]

    @property
    def grad_shard_is_view_of_full(self) -> bool:
        """The gradient shard is a slice of `grad_full` (it holds no memory of its own)."""
        return self.grad_shard is not None and self.grad_full is not None and self.grad_shard._base is self.grad_full

    def _grad_buffer(self) -> torch.Tensor:
        if self.grad_shard_is_view_of_full:
            self.grad_shard = self.grad_shard.clone()  # grad_full is about to be written
        if self.grad_full is None:
            # Uninitialized: every slot is written by its gradient or zeroed by ensure_grad_full.
            if self.grad_pool is not None:
                self.grad_full = self.grad_pool.take(self.padded_numel, self.data.dtype, self.data.device)
            else:
                self.grad_full = torch.empty(self.padded_numel, dtype=self.data.dtype, device=self.data.device)
            if self.padding:
                self.grad_full[self.numel :].zero_()  # the padding: no parameter ever writes it
            self.clear_grad_full()
        return self.grad_full

    def grad_of_shard(self) -> torch.Tensor:
        """The gradient of this rank's slice: the reduced shard, or a view of the whole gradient."""
        if self.sharded:
            if self.grad_shard is None:
                # Offloaded: the shard's gradient lives with the master, on the CPU, so each bucket's
                # reduced gradient leaves the device as soon as its reduce-scatter completes.
                device = self.master.device if self.master is not None else self.data.device
                self.grad_shard = _on(torch.zeros(self.shard_size, dtype=self.data.dtype, device=device), pin=True)
            return self.grad_shard
        return self.ensure_grad_full()


def shard_layout(numel: int, world_size: int, rank: int, sharded: bool) -> tuple[int, int, int]:
    """(padded_numel, shard_size, shard_start) of a bucket of `numel` elements.

    Sharded buffers are padded so that every rank owns an equal slice; unsharded ones are
    the rank's "shard" whole. Pure arithmetic, shared with the memory estimator.
    """
    parts = world_size if sharded else 1
    padded_numel = math.ceil(numel / parts) * parts
    shard_size = padded_numel // parts
    return padded_numel, shard_size, rank * shard_size if sharded else 0


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _on(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """Page-locked when asked and possible: host<->GPU copies of pinned memory run asynchronously."""
    return t.pin_memory() if pin and t.device.type == "cpu" and torch.cuda.is_available() else t


def split_into_buckets(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Groups parameters, in the given order, into buckets of at most `bucket_numel` elements.

    A parameter larger than the bucket size gets a bucket of its own.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        buckets.append(current)
    return buckets
