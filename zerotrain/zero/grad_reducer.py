"""GradReducer: collects gradients into FlatParam buckets and reduces them.

A post-accumulate-grad hook on every trainable parameter copies its gradient
into its bucket's whole-gradient buffer and drops `param.grad`. When reduction
happens during backward (stages 0 and 1 at the accumulation boundary, stages 2
and 3 on every micro-step), a bucket is launched asynchronously as soon as all
of its parameters have reported, while backward goes on. Buckets are always launched
in one fixed order so every rank issues the same collectives in the same
sequence, whatever parameters its data left unused; the rest are flushed by a
callback at the end of backward.

Stage 0 all-reduces the whole gradient. Stages 1-3 reduce-scatter it into the
rank's gradient shard; stage 1 keeps the whole-gradient buffer for the next
accumulation, stages 2-3 free it, so between micro-steps a rank keeps only its
shard. Stage 1's shard exists only from the boundary backward to the step: the
reduction writes straight into a new one (NCCL), or, on Gloo, whose reduce-scatter
is an all-reduce of a clone of its input, the bucket is all-reduced in place and the
shard is the rank's slice of it, so no copy and no Ψ-sized temporary is made. A
backward that does not reduce (stages 0-1 before the boundary, or inside
`no_sync()`) leaves `unreduced` set; the engine's step then reduces what is left.
With the optimizer on NVMe (stages 2-3) the shard is parked on disk too
(`nvme_grads.py`). At stages 2-3 the whole-gradient buffers and reduce-scatter
temporaries are lent by a GradBufferPool from one bucket to the next, emptied at the end
of each reducing backward (`grad_buffer_pool.py`). The hooks run eagerly under
torch.compile (`eager_hooks.py`).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from zerotrain.comm import distributed as zdist
from zerotrain.zero.eager_hooks import eager_hook
from zerotrain.zero.flat_param import FlatParam
from zerotrain.zero.grad_buffer_pool import GradBufferPool

# Reductions in flight before the oldest is waited on: bounds the memory held by
# whole-gradient buffers awaiting their reduce-scatter.
_MAX_IN_FLIGHT = 2


class GradReducer:
    """Hooks gradients into buckets and averages them over the data-parallel ranks."""

    def __init__(
        self,
        flat_params: list[FlatParam],
        stage: int,
        world_size: int,
        comm_dtype: torch.dtype | None,
        prescale_gradients: bool,
        predivide_factor: float,
        grad_swap=None,
    ) -> None:
        self.flat_params = flat_params
        self.stage = stage
        self.comm_dtype = comm_dtype
        # DeepSpeed's scaling around the sum; the product is always 1/N. Its ZeRO optimizers
        # (stages 1-3) divide by N before the sum, so that fp16 gradients that fit on each rank
        # cannot overflow in the sum: dividing after it made zerotrain skip fp16 steps that
        # DeepSpeed takes. Stage 0 (its engine's all-reduce) divides by the pre-divide factor
        # before and the rest after, unless prescale_gradients says all before.
        if prescale_gradients:
            self.pre_scale, self.post_scale = 1.0 / world_size, 1.0
        elif stage >= 1:
            self.pre_scale, self.post_scale = 1.0 / (predivide_factor * world_size), predivide_factor
        else:
            self.pre_scale, self.post_scale = 1.0 / predivide_factor, predivide_factor / world_size
        self.reduce_in_backward = False
        self.unreduced = False  # gradients accumulated by a backward that did not reduce them
        self.boundary = True  # this backward ends the accumulation: its gradients are the step's last
        self.grad_swap = grad_swap  # NvmeGradOffload: reduced shards parked on NVMe
        # Gloo: reduce-scatter by all-reducing the bucket in place (see zdist.reduce_scatter_in_place).
        self.in_place = dist.is_initialized() and zdist.reduce_scatter_is_all_reduce()
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}
        for b, fp in enumerate(flat_params):
            for i, p in enumerate(fp.params):
                self._slot[p] = (b, i)
        self._ready: list[set[int]] = [set() for _ in flat_params]
        self._next_launch = 0
        self._in_flight: deque = deque()
        self._callback_queued = False
        # Stages 2-3 drop each whole gradient once reduced: its buffer serves the next bucket.
        self.pool = GradBufferPool() if stage >= 2 else None
        for fp in flat_params:
            fp.grad_pool = self.pool
        self._on_backward_end_eager = eager_hook(self._on_backward_end)
        on_grad = eager_hook(self._on_grad)
        self._handles = [p.register_post_accumulate_grad_hook(on_grad) for p in self._slot]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    # --- during backward -------------------------------------------------------------

    def _on_grad(self, param: nn.Parameter) -> None:
        b, i = self._slot[param]
        fp = self.flat_params[b]
        if self.reduce_in_backward and b < self._next_launch:
            raise RuntimeError(
                f"parameter {fp.names[i]!r} received a second gradient after its bucket was reduced in this "
                "backward pass (reentrant activation checkpointing?). Use non-reentrant checkpointing "
                "(use_reentrant=False)."
            )
        fp.add_grad(i, param.grad)
        param.grad = None
        self._ready[b].add(i)
        if not self.reduce_in_backward:
            self.unreduced = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end_eager)
        if self.reduce_in_backward:
            while self._next_launch < len(self.flat_params) and len(self._ready[self._next_launch]) == len(
                self.flat_params[self._next_launch].params
            ):
                self._launch(self._next_launch)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if self.reduce_in_backward:
            self.reduce_remaining()
        for ready in self._ready:
            ready.clear()
        self._next_launch = 0

    # --- reduction ---------------------------------------------------------------------

    def reduce_remaining(self) -> None:
        """Launches every bucket not yet launched (unused parameters count as zeros) and waits."""
        while self._next_launch < len(self.flat_params):
            self._launch(self._next_launch)
        while self._in_flight:
            self._complete(*self._in_flight.popleft())
        self._next_launch = 0
        self.unreduced = False
        if self.pool is not None:
            self.pool.clear()  # between backwards a rank holds only its gradient shards

    @property
    def in_flight(self) -> int:
        """Reductions launched and not yet completed (0 once a reducing backward has returned)."""
        return len(self._in_flight)

    def _launch(self, b: int) -> None:
        self._next_launch = b + 1
        fp = self.flat_params[b]
        lent = None  # a reduce-scatter temporary from the pool, given back once added into the shard
        grad = fp.ensure_grad_full()
        send = grad if self.comm_dtype in (None, grad.dtype) else grad.to(self.comm_dtype)
        if self.pre_scale != 1.0:
            send.mul_(self.pre_scale)
        if self.stage == 0:
            work = zdist.all_reduce(send, "grad", async_op=True)
            out = send
        else:
            if self.in_place:
                work = zdist.reduce_scatter_in_place(send, "grad", async_op=True)
                out = send[fp.shard_start : fp.shard_start + fp.shard_size]  # the rank's part of the sum
            else:
                out = self._reduce_scatter_target(fp, send)
                work = zdist.reduce_scatter(out, send, "grad", async_op=True)
                lent = out if self.pool is not None else None
            if self.grad_swap is not None:
                self.grad_swap.prefetch(fp)  # the shard so far comes in while the reduction runs
        if self.stage == 3:
            fp.free()  # the unit's backward is done: its parameters are not needed until next forward
        self._in_flight.append((fp, work, send, out, lent))
        if len(self._in_flight) > _MAX_IN_FLIGHT:
            self._complete(*self._in_flight.popleft())

    def _complete(self, fp: FlatParam, work, send: torch.Tensor, out: torch.Tensor, lent: torch.Tensor | None) -> None:
        work.wait()
        if self.post_scale != 1.0:
            out.mul_(self.post_scale)
        if self.stage == 0:
            if send is not fp.grad_full:
                fp.grad_full.copy_(send)
            return
        if self.grad_swap is not None:
            self.grad_swap.accumulate(fp, out, final=self.boundary)  # reads `out` before it returns
            self._give_back(fp, lent)
            return
        if self.stage == 1 and fp.grad_shard is None and send is fp.grad_full:
            fp.use_grad_full_slice_as_shard()  # in place (Gloo): the shard is `out`, no copy
            fp.clear_grad_full()
            return
        shard = fp.grad_of_shard()
        if out is not shard:
            shard.add_(out.to(shard.device))  # a blocking copy: the add must see the data
        if self.stage == 1:
            fp.clear_grad_full()  # kept allocated: stage 1 holds whole gradients between steps
        else:
            self._give_back(fp, lent)  # stages 2 and 3 keep only the shard

    def _give_back(self, fp: FlatParam, lent: torch.Tensor | None) -> None:
        """Stages 2-3, a bucket reduced and added into its shard: its buffers serve the next bucket."""
        fp.release_grad_full()
        if lent is not None:
            self.pool.give_back(lent)

    def _reduce_scatter_target(self, fp: FlatParam, send: torch.Tensor) -> torch.Tensor:
        """Where a bucket's reduce-scatter writes.

        Stage 1 starts every step without a gradient shard (the engine's zero_grad drops
        it): the first reduction of the step writes straight into a new one, with no
        temporary and no add. Otherwise (stages 2-3 accumulating over micro-steps, a
        second backward before the step, a shard offloaded or in another dtype) a
        temporary, added into the shard when the reduction completes.
        """
        if (
            self.stage == 1
            and fp.grad_shard is None
            and self.grad_swap is None
            and send.dtype == fp.data.dtype
            and fp.master.device == send.device
        ):
            fp.grad_shard = torch.empty(fp.shard_size, dtype=send.dtype, device=send.device)
            return fp.grad_shard
        if self.pool is not None:
            return self.pool.take(fp.shard_size, send.dtype, send.device)
        return torch.empty(fp.shard_size, dtype=send.dtype, device=send.device)
